"""MoEConfig.dispatch='auto' (models/moe.py): the per-platform rule, that it is the committed report of
`bench moe_dispatch`, that a forward runs the path the rule names and equals both fixed paths, and the
bench's own mechanics on the CPU compiler."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from d2f_jax.bench import moe_dispatch as bench
from d2f_jax.models import moe as moe_lib
from d2f_jax.models import preset

REPORT = os.path.join(os.path.dirname(bench.__file__), "reports", "moe_dispatch.json")
CONFIG = preset("tiny-llada2")


def _auto(dispatch: str = "auto"):
  return dataclasses.replace(CONFIG.moe, dispatch=dispatch)


def test_auto_follows_each_platforms_rule():
  auto = _auto()
  for platform, rule in moe_lib.AUTO_DISPATCH.items():
    start = 1
    for limit, dispatch in rule:
      end = limit if limit is not None else start + 10_000
      assert {moe_lib.dispatch_for(auto, n, platform) for n in (start, end)} == {dispatch}, (platform, start, end)
      start = end + 1
  assert moe_lib.dispatch_for(auto, 1, "cuda") == moe_lib.dispatch_for(auto, 1, "gpu")
  assert moe_lib.dispatch_for(auto, 10 ** 6, "metal") == "ragged"  # no rule: the default
  # a long forward (a 32-slot engine's ~3,000 tokens, a prefill) stays dense on GPU: ragged expands there
  mini = dataclasses.replace(preset("llada2-mini").moe, dispatch="auto")
  assert moe_lib.dispatch_for(mini, 3_000, "gpu") == moe_lib.dispatch_for(mini, 10 ** 6, "gpu") == "dense"
  for fixed in ("dense", "ragged"):  # a fixed dispatch is never overridden
    assert {moe_lib.dispatch_for(_auto(fixed), n, p) for n in (1, 10 ** 6) for p in ("cpu", "gpu", "tpu")} == {fixed}


def test_the_rule_is_the_committed_reports():
  with open(REPORT) as f:
    report = json.load(f)
  targets = {r["target"]: r for r in report["targets"]}
  assert report["model"] == "llada2-mini"
  for platform, target in moe_lib.AUTO_SOURCES.items():
    row = targets[target]
    ms = {d: {int(n): v for n, v in row["ms"][d].items()} for d in bench.DISPATCHES}
    assert bench.segments(ms) == row["segments"], target  # the report's segments follow from its costs
    assert tuple(tuple(s) for s in row["segments"]) == moe_lib.AUTO_DISPATCH[platform], (platform, target)


def _weights(key):
  moe, e = CONFIG.moe, CONFIG.embed_dim
  x, f, s = moe.num_experts, moe.expert_mlp_dim, moe.shared_mlp_dim
  shapes = {"router": (e, x), "expert_gate": (x, e, f), "expert_up": (x, e, f), "expert_down": (x, f, e),
            "expert_bias": (x,)}
  if moe.num_shared_experts:
    shapes.update(shared_gate=(e, s), shared_up=(e, s), shared_down=(s, e))
  keys = jax.random.split(key, len(shapes))
  return {name: 0.2 * jax.random.normal(k, shape, jnp.float32) for k, (name, shape) in zip(keys, shapes.items())}


def test_an_auto_forward_runs_the_chosen_path_and_equals_both(monkeypatch):
  """With a CPU rule of ragged up to 8 tokens, dense beyond: a 3-token forward holds a ragged_dot, a 24-token
  one none, and both equal the fixed dispatches to float32 summation order."""
  monkeypatch.setitem(moe_lib.AUTO_DISPATCH, "cpu", ((8, "ragged"), (None, "dense")))
  monkeypatch.setattr(jax, "default_backend", lambda: "cpu")  # the rule patched is the CPU's, whatever runs
  w = _weights(jax.random.PRNGKey(0))
  for tokens, path in ((3, "ragged"), (24, "dense")):
    h = jax.random.normal(jax.random.PRNGKey(tokens), (1, tokens, CONFIG.embed_dim), jnp.float32)
    jaxpr = str(jax.make_jaxpr(lambda h, w: moe_lib.moe_mlp(h, w, _auto())[0])(h, w))
    assert ("ragged_dot" in jaxpr) == (path == "ragged"), tokens
    got = np.asarray(moe_lib.moe_mlp(h, w, _auto())[0])
    for fixed in ("dense", "ragged"):
      np.testing.assert_allclose(got, np.asarray(moe_lib.moe_mlp(h, w, _auto(fixed))[0]), rtol=1e-5, atol=1e-6)


def test_the_bench_prices_both_paths_on_the_cpu_compiler(tmp_path, capsys):
  path = str(tmp_path / "moe.json")
  assert bench.main(["--target", "cpu", "--model", "tiny-llada2", "--tokens", "1,16", "--json", path]) == 0
  with open(path) as f:
    (row,) = json.load(f)["targets"]
  assert row["target"] == "cpu" and set(row["ms"]) == {"dense", "ragged"}
  assert all(row["costs"][d][n]["flops"] > 0 for d in ("dense", "ragged") for n in ("1", "16"))
  assert row["segments"][-1][0] is None and {d for _, d in row["segments"]} <= {"dense", "ragged"}
  assert "PROJECTION" in capsys.readouterr().out


def test_a_model_without_experts_is_refused():
  with pytest.raises(ValueError, match="not a mixture-of-experts preset"):
    bench.main(["--target", "cpu", "--model", "tiny-llada", "--tokens", "1", "--json", "/dev/null"])


def test_the_dispatch_is_set_from_a_config_a_flag_and_load_model(tmp_path):
  """How the experts are computed is a run's choice, not the checkpoint's: `config.model.expert_dispatch`
  (the trainer, aot), `--expert_dispatch` (generate, evaluate, serve) and load_model's argument all reach
  MoEConfig.dispatch; a dense model or an unknown dispatch is refused naming the field."""
  import argparse

  import d2f_jax
  from d2f_jax.convert import synthetic
  from d2f_jax.decode.flags import add_device_flags
  from d2f_jax.train.config import base_config, validate
  from d2f_jax.train.model import model_config

  c = base_config()
  c.model.preset, c.model.expert_dispatch = "tiny-llada2", "dense"
  assert model_config(c.model).moe.dispatch == "dense"
  c.model.expert_dispatch = None
  assert model_config(c.model).moe.dispatch == "ragged"
  c.model.preset, c.model.expert_dispatch = "tiny-llada", "auto"
  with pytest.raises(ValueError, match=r"config.model.expert_dispatch='auto'.*no experts"):
    model_config(c.model)
  c.model.preset, c.model.expert_dispatch = "tiny-llada2", "sparse"
  with pytest.raises(ValueError, match="model.expert_dispatch"):
    validate(c)

  parser = argparse.ArgumentParser()
  add_device_flags(parser)
  assert parser.parse_args(["--expert_dispatch", "dense"]).expert_dispatch == "dense"
  assert parser.parse_args([]).expert_dispatch is None
  with pytest.raises(SystemExit):
    parser.parse_args(["--expert_dispatch", "sparse"])

  synthetic.write_hf_checkpoint(tmp_path, preset("tiny-llada2"), seed=0, dtype="float32", tokenizer=False)
  assert d2f_jax.load_model(str(tmp_path), expert_dispatch="dense").config.moe.dispatch == "dense"
  assert d2f_jax.load_model(str(tmp_path)).config.moe.dispatch == "ragged"
  with pytest.raises(ValueError, match="no experts"):
    preset("tiny-llada").with_expert_dispatch("dense")
