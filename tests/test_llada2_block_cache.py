"""method='llada2' with block_cache (decode/block_sampler.py): finished blocks' K/V cached, two blocks fed a
step. Greedy decoding equals the released loop (which recomputes the whole sequence every step) token for
token, forward for forward, on LLaDA2.0's sampler and LLaDA2.1's editing, rows of several prompt lengths
stopping at different blocks; and it feeds 2 x block positions a step, not the sequence."""

import numpy as np
import pytest

from d2f_jax.decode import DecodeConfig, generate
from d2f_jax.decode.config import SettingError
from d2f_jax.models.config import TINY_LLADA2

PROMPTS = [[11, 23, 5, 101, 7], [3, 14, 15, 92, 65, 35, 89, 79, 32], [99, 98], [5, 6, 7, 8, 9, 10, 11, 12]]
CASES = [dict(), dict(tau_conf=0.5, stop_ids=()), dict(steps=2), dict(editing_threshold=0.5, tau_conf=0.7),
         dict(editing_threshold=0.0, tau_conf=0.5, max_post_steps=3, stop_ids=())]


@pytest.fixture(scope="module")
def sharp():
  """A random tiny LLaDA2 (block-causal) with a 4x head, so confidences spread over (0, 1) as a trained one's."""
  from d2f_jax.api import Model
  from model_utils import random_model
  module = random_model(TINY_LLADA2.replace(attention_kind="block_causal"), seed=0)
  module.lm_head[...] = module.lm_head[...] * 4.0
  return Model.from_module(module)


@pytest.mark.parametrize("case", CASES, ids=[",".join(f"{k}={v}" for k, v in c.items()) or "default" for c in CASES])
def test_the_cached_loop_decodes_as_the_released_one(sharp, case):
  config = DecodeConfig(method="llada2", block_size=4, max_new_tokens=16, prompt_buckets=16, **case)
  released, cached = generate(sharp, PROMPTS, config), generate(sharp, PROMPTS, config.replace(block_cache=True))
  for field in ("tokens", "lengths", "forwards", "trace"):
    np.testing.assert_array_equal(np.asarray(getattr(cached, field)), np.asarray(getattr(released, field)),
                                  err_msg=field)
  assert len(set(np.asarray(released.forwards).tolist())) > 1  # rows end at different steps


def test_a_cached_step_feeds_two_blocks():
  """The forward a step runs: [B, 2 x block] tokens with the cache, against the released [B, W + N + block]."""
  import jax
  import jax.numpy as jnp
  from model_utils import random_model
  from d2f_jax.decode import block_sampler
  from d2f_jax.decode.config import resolve
  model_config = TINY_LLADA2.replace(attention_kind="block_causal")
  inner = random_model(model_config, seed=0)
  widths = {}
  for cache in (False, True):
    spec, knobs = resolve(DecodeConfig(method="llada2", block_size=4, max_new_tokens=16, block_cache=cache),
                          model_config)
    seen = []

    class Spy:  # the model as the sampler calls it, recording each forward's tokens and whether a cache is read
      def hidden_states(self, tokens, positions, ids, cache=None):
        seen.append((tokens.shape, cache is not None))
        return inner.hidden_states(tokens, positions, ids, cache)

      def logits_from_hidden(self, hidden):
        return inner.logits_from_hidden(hidden)
    prompt = jnp.full((2, 16), 5, jnp.int32)
    state = jax.eval_shape(lambda: block_sampler.init(Spy(), prompt, jnp.array([5, 9]), jax.random.key(0), knobs,
                                                      spec))
    seen.clear()
    jax.eval_shape(lambda s: block_sampler.step(Spy(), s, knobs, spec), state)
    widths[cache] = seen
  assert widths == {False: [((2, 16 + 16 + 4), False)], True: [((2, 8), True)]}


def test_block_cache_is_a_setting_of_llada2_only():
  for kw in (dict(block_cache=True), dict(method="llada2", block_cache=1)):
    with pytest.raises(SettingError, match="block_cache") as error:
      DecodeConfig(**kw)
    assert error.value.field == "block_cache"
