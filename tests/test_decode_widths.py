"""Window widths that follow the blocks in flight: every width set decodes exactly like the plain reference
(tokens, forwards, trace, diagnostics), the defaults are the authors' uncapped loop, and a width set is one
compiled program. Greedy, fp32, random tiny models with a sharpened head (see test_decode.sharp_model)."""

import numpy as np
import pytest

from d2f_jax.decode import DecodeConfig, generate, resolve, trace_count
from d2f_jax.decode.methods import check_method_fits
from d2f_jax.decode.widths import window_widths_for
from test_decode import PROMPTS, assert_rows_match, d2f_reference, sharp_model

PAPER = dict(tau_add=0.1, tau_act=0.95, tau_conf=0.9)
# (block_size, max_new_tokens, thresholds): paper thresholds, then settings that keep several blocks in flight.
CASES = [(4, 24, PAPER), (4, 24, dict(tau_add=0.0, tau_act=0.75, tau_conf=0.3)),
         (8, 32, dict(tau_add=0.25, tau_act=0.5, tau_conf=0.5)), (2, 16, dict(tau_add=0.5, tau_act=1.0, tau_conf=0.6))]


def _check(model, config, prompts=PROMPTS, expected=None):
  result = generate(model, prompts, config)
  expected = expected or [d2f_reference(model, p, config) for p in prompts]
  assert_rows_match(result, expected, prompts)
  np.testing.assert_array_equal(np.asarray(result.in_flight_sum), [e["in_flight_sum"] for e in expected])
  return result, expected


# The width logic does not depend on the family; each family takes half the cases (each case compiles three
# programs), and the defaults test below runs both.
@pytest.mark.parametrize("family,case", [("llada", 0), ("dream", 1), ("llada", 2), ("dream", 3)])
def test_width_sets_equal_the_reference(family, case):
  """Default widths and the widest window only (every case), a sparse set (one case), uncapped; alone, with
  every width compiled, each forward's window is exactly the reference's uncached blocks."""
  block, new, taus = CASES[case]
  model = sharp_model(family)
  base = DecodeConfig(block_size=block, max_new_tokens=new, stop_ids=(), prompt_buckets=16, **taus)
  blocks = new // block
  expected = [d2f_reference(model, p, base) for p in PROMPTS]
  results = {}
  for widths in (None, ()) + (((2,),) if case == 1 else ()):
    results[widths], _ = _check(model, base.replace(window_widths=widths), expected=expected)
  # The fixed window pays the widest window every forward; the width set pays less whenever it can.
  forwards = np.asarray(results[()].forwards)
  np.testing.assert_array_equal(np.asarray(results[()].window_sum), forwards * blocks)
  assert (np.asarray(results[None].window_sum) < forwards * blocks).all()
  # A batch runs the width its widest row needs; a row alone runs its own.
  exact = generate(model, PROMPTS[2:], base.replace(window_widths=tuple(range(1, blocks + 1))))
  assert int(exact.window_sum[0]) == expected[2]["window_sum"]


def test_widths_with_a_cap_and_threshold():
  model = sharp_model("llada")
  config = DecodeConfig(block_size=4, max_new_tokens=24, max_blocks_in_flight=2, tau_add=0.0, tau_act=0.5,
                        tau_conf=0.4, stop_ids=(), prompt_buckets=16)
  result, _ = _check(model, config)
  assert int(np.asarray(result.max_in_flight).max()) == 2
  threshold = DecodeConfig(method="threshold", block_size=4, max_new_tokens=24, tau_conf=0.5, prompt_buckets=16)
  assert resolve(threshold, model.config)[0].window_widths == (1, 2)
  _check(model, threshold)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_defaults_are_the_uncapped_reference_at_paper_thresholds(family):
  """DecodeConfig() has no cap: its tokens are the reference loop's; a cap is an option that changes them."""
  assert DecodeConfig().max_blocks_in_flight is None
  assert (DecodeConfig().tau_add, DecodeConfig().tau_act, DecodeConfig().tau_conf) == (0.1, 0.95, 0.9)
  model = sharp_model(family)
  prompts = PROMPTS + [[7, 7, 7], [400, 3, 99, 12, 5, 5]]
  config = DecodeConfig(block_size=4, max_new_tokens=32, stop_ids=(), prompt_buckets=16)
  default, _ = _check(model, config, prompts)
  assert int(np.asarray(default.max_in_flight).max()) >= 3  # the reference really pipelines here
  capped = generate(model, prompts, config.replace(max_blocks_in_flight=1))
  assert not np.array_equal(np.asarray(capped.trace), np.asarray(default.trace))  # a cap changes the decode


def test_one_program_for_every_width():
  model = sharp_model("dream")
  config = DecodeConfig(block_size=4, max_new_tokens=24, tau_add=0.0, tau_act=0.5, tau_conf=0.4,
                        stop_ids=(), prompt_buckets=16)
  generate(model, PROMPTS, config)
  before = trace_count("loop")
  narrow = generate(model, PROMPTS, config.replace(tau_add=1.0, tau_conf=0.95))  # other widths, same program
  wide = generate(model, PROMPTS, config)
  assert trace_count("loop") == before
  assert np.asarray(narrow.window_sum).sum() / np.asarray(narrow.forwards).sum() < \
      np.asarray(wide.window_sum).sum() / np.asarray(wide.forwards).sum()


def test_width_set_resolution_and_errors():
  assert window_widths_for(None, 5) == (1, 2, 3, 4, 5)
  assert window_widths_for(None, 16) == (1, 2, 3, 4, 5, 9, 16)
  assert window_widths_for((), 6) == (6,)
  assert window_widths_for((8, 2, 2), 4) == (2, 4)  # cut to the widest window, which is always there
  with pytest.raises(ValueError, match="window_widths"):
    DecodeConfig(window_widths=(0, 2))
  with pytest.raises(ValueError, match="window_widths"):
    DecodeConfig(window_widths=[1, 2])
  with pytest.raises(ValueError, match="max_blocks_in_flight"):
    DecodeConfig(max_blocks_in_flight=0)


def test_method_that_does_not_fit_the_model_is_refused():
  model = sharp_model("llada").config
  for method in ("d2f", "threshold", "vanilla", "dream_vanilla"):
    with pytest.raises(ValueError, match="trained causally"):
      check_method_fits(model, DecodeConfig(method=method, block_size=4, max_new_tokens=16), "causal")
    check_method_fits(model, DecodeConfig(method=method, block_size=4, max_new_tokens=16), "bidirectional")
  with pytest.raises(ValueError, match="needs a causal model"):
    check_method_fits(model, DecodeConfig(method="ar"), "bidirectional")
  with pytest.raises(ValueError, match="block-causal"):
    check_method_fits(model, DecodeConfig(method="ar"), "block_causal")
  check_method_fits(model, DecodeConfig(method="ar"), "causal")
  check_method_fits(model, DecodeConfig(method="ar"), None)  # unknown: nothing to check
  with pytest.raises(ValueError, match="mask token"):
    check_method_fits(model.replace(mask_token_id=model.vocab_size), DecodeConfig(), None)


def test_bench_width_table_runs_and_checks_tokens(tmp_path):
  """`python -m d2f_jax.bench decode`'s before/after table: same tokens (it raises otherwise), narrower
  mean windows with the width set, one row per tau_add."""
  import json
  from d2f_jax.bench import decode as bench_decode
  out = tmp_path / "bench.json"
  bench_decode.main(["--family", "", "--max_new_tokens", "32", "--block_size", "8", "--repeats", "1",
                     "--width_tau_add", "1.0,0.0", "--out", str(out)])
  rows = json.loads(out.read_text())["widths"]
  assert [r["tau_add"] for r in rows] == [1.0, 0.0]
  for row in rows:
    assert row["fixed_window"] == 4 and row["width_set_window"] < row["fixed_window"]
    assert row["in_flight"] <= row["width_set_window"]


def test_resolved_once_per_config_and_unhashable_fields_still_decode():
  """The runner resolves a (config, model config) once; a config with list fields (unhashable) is resolved
  afresh each call and decodes exactly as its tuple twin."""
  from d2f_jax.decode.runner import inputs as runner_prepare
  model = sharp_model("llada")
  config = DecodeConfig(block_size=4, max_new_tokens=16, prompt_buckets=16, stop_ids=(3,))
  runner_prepare._resolved.cache_clear()
  first = generate(model, PROMPTS, config)
  generate(model, PROMPTS, config.replace())  # an equal config: a cache hit
  assert runner_prepare._resolved.cache_info().hits == 1 and runner_prepare._resolved.cache_info().misses == 1
  listed = generate(model, PROMPTS, config.replace(stop_ids=[3], prompt_buckets=[16]))
  assert runner_prepare._resolved.cache_info().misses == 1  # not cached, not failed
  np.testing.assert_array_equal(np.asarray(listed.tokens), np.asarray(first.tokens))
  np.testing.assert_array_equal(np.asarray(listed.forwards), np.asarray(first.forwards))
