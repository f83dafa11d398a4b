"""The approximate cache of decided positions in flight (DecodeConfig.cache_decided, decode/query_window.py).

A one-layer model's K/V depend on each position's own token and position only, so for it the kept K/V are
exact and the mode must decode the query-limited loop's tokens (and the plain reference's) exactly, at
fewer positions; any kept K/V that is missing, seen twice or seen by the wrong block changes its logits.
Deeper models: rows decode as alone, fewer positions than without the cache, the same code the engine runs.
"""

import dataclasses

import numpy as np
import pytest

from d2f_jax.decode import DecodeConfig, generate
from d2f_jax.api import Model
from model_utils import random_model
from test_decode import (BASE, CONFIGS, PROMPTS, THRESHOLDS, assert_rows_decode_as_alone, assert_rows_match,
                         sharp_model)
from test_decode_query import query_reference

_ONE_LAYER = {}


def one_layer_model(family: str) -> Model:
  if family not in _ONE_LAYER:
    module = random_model(dataclasses.replace(CONFIGS[family], num_layers=1), seed=3)
    module.lm_head[...] = module.lm_head[...] * 4.0  # top-1 probabilities spread over (0, 1)
    _ONE_LAYER[family] = Model.from_module(module)
  return _ONE_LAYER[family]


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_one_layer_kept_kv_is_exact_so_the_tokens_are_the_query_loops(family):
  model = one_layer_model(family)
  fewer = False
  for query_limit in (None, 2):
    for tau_conf, tau_add, tau_act in THRESHOLDS[:3]:
      config = BASE.replace(tau_conf=tau_conf, tau_add=tau_add, tau_act=tau_act, query_limit=query_limit)
      plain = config.replace(query_limit=query_limit or config.block_size)
      kept = generate(model, PROMPTS, config.replace(cache_decided=True))
      assert_rows_match(kept, [query_reference(model, p, plain) for p in PROMPTS], PROMPTS, stats=False)
      without = generate(model, PROMPTS, plain)
      for name in ("tokens", "lengths", "forwards", "trace"):
        np.testing.assert_array_equal(np.asarray(getattr(kept, name)), np.asarray(getattr(without, name)), name)
      assert (np.asarray(kept.position_sum) <= np.asarray(without.position_sum)).all()
      fewer |= bool((np.asarray(kept.position_sum) < np.asarray(without.position_sum)).any())
  assert fewer, "the cache never saved a position: the comparison could not tell the modes apart"


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_rows_decode_as_alone_at_fewer_positions(family):
  model = sharp_model(family)
  config = BASE.replace(tau_conf=0.5, tau_add=0.25, tau_act=0.5, query_limit=2, cache_decided=True)
  batch = assert_rows_decode_as_alone(model, PROMPTS, config)
  without = generate(model, PROMPTS, config.replace(cache_decided=False))
  assert np.asarray(batch.position_sum).sum() < np.asarray(without.position_sum).sum()


def test_config_errors():
  for bad in (1, "yes", None):
    with pytest.raises(ValueError, match="cache_decided must be a bool"):
      DecodeConfig(cache_decided=bad)
  with pytest.raises(ValueError, match="cache_decided"):
    DecodeConfig(method="vanilla", cache_decided=True)
  DecodeConfig(method="threshold", cache_decided=True)
