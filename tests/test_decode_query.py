"""The query-limited d2f mode (DecodeConfig.query_limit, decode/query_window.py) agrees token for token with
the plain reference that feeds only the chosen positions (fp32, greedy), rows decode as alone, and a limit
at least a block wide decodes the exact loop's tokens."""

import numpy as np
import pytest

import decode_reference as ref
from d2f_jax.decode import DecodeConfig, generate
from d2f_jax.decode.config import resolve
from d2f_jax.decode.widths import query_widths_for
from test_decode import (BASE, PROMPTS, THRESHOLDS, _stops, assert_rows_decode_as_alone, assert_rows_match,
                         d2f_reference, sharp_model)


def query_reference(model, prompt, config):
  run = config.effective()
  return ref.d2f(model, prompt, block_size=run.block_size, max_new_tokens=run.max_new_tokens,
                 max_blocks_in_flight=run.max_blocks_in_flight, tau_add=run.tau_add, tau_act=run.tau_act,
                 tau_conf=run.tau_conf, stop_ids=_stops(model, run), query_limit=run.query_limit)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_query_limited_d2f_matches_its_reference(family):
  model = sharp_model(family)
  differs = False
  for query_limit in (1, 2):
    for tau_conf, tau_add, tau_act in THRESHOLDS[:3]:
      config = BASE.replace(tau_conf=tau_conf, tau_add=tau_add, tau_act=tau_act, query_limit=query_limit)
      result = generate(model, PROMPTS, config)
      expected = [query_reference(model, p, config) for p in PROMPTS]
      assert_rows_match(result, expected, PROMPTS)
      exact = [d2f_reference(model, p, config.replace(query_limit=None)) for p in PROMPTS]
      differs |= any((e["trace"] != x["trace"]).any() for e, x in zip(expected, exact))
  assert differs, "the mode never changed a decode: the comparison could not tell it from the exact loop"


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_a_limit_of_a_whole_block_decodes_the_exact_tokens_at_fewer_positions(family):
  """q >= block size feeds every position of every block that exists, as the exact loop does; only blocks
  not yet appended (invisible anyway) are left out, so the tokens are the exact ones and the compiled width
  is never larger."""
  model = sharp_model(family)
  config = BASE.replace(tau_conf=0.5, tau_add=0.25, tau_act=0.5)
  exact = generate(model, PROMPTS, config)
  whole = generate(model, PROMPTS, config.replace(query_limit=config.block_size))
  for name in ("tokens", "lengths", "forwards", "trace", "max_in_flight", "semi_steps", "max_accepted"):
    np.testing.assert_array_equal(np.asarray(getattr(whole, name)), np.asarray(getattr(exact, name)), err_msg=name)
  assert (np.asarray(whole.position_sum) <= np.asarray(exact.position_sum)).all()
  # The exact loop's positions are its compiled widths in blocks.
  np.testing.assert_array_equal(np.asarray(exact.position_sum), np.asarray(exact.window_sum) * config.block_size)


def test_query_limited_rows_decode_as_alone_and_compute_fewer_positions():
  model = sharp_model("dream")
  config = BASE.replace(tau_conf=0.5, tau_add=0.0, tau_act=0.5, query_limit=1)
  batch = assert_rows_decode_as_alone(model, PROMPTS, config)
  exact = generate(model, PROMPTS, config.replace(query_limit=None))
  per_forward = np.asarray(batch.position_sum) / np.asarray(batch.forwards)
  exact_per_forward = np.asarray(exact.position_sum) / np.asarray(exact.forwards)
  assert (per_forward < exact_per_forward).all(), (per_forward, exact_per_forward)


def test_threshold_takes_the_limit_too():
  model = sharp_model("llada")
  config = DecodeConfig(method="threshold", block_size=4, max_new_tokens=16, tau_conf=0.5, prompt_buckets=16,
                        query_limit=2)
  result = generate(model, PROMPTS, config)
  assert_rows_match(result, [query_reference(model, p, config) for p in PROMPTS], PROMPTS)


def test_compiled_widths_and_config_errors():
  assert query_widths_for(32, (1, 2, 3, 4, 5, 9)) == (16, 32, 48, 64, 80, 96, 112, 128, 160, 288)
  assert query_widths_for(4, (1, 2)) == (2, 4, 6, 8)  # cut at the largest window
  assert query_widths_for(1, (1, 3)) == (1, 2, 3)
  spec, knobs = resolve(BASE.replace(query_limit=2), sharp_model("llada").config)
  assert spec.query_mode and spec.query_widths[-1] == spec.window and int(knobs.query_limit) == 2
  spec, knobs = resolve(BASE, sharp_model("llada").config)
  assert not spec.query_mode and spec.query_widths == () and int(knobs.query_limit) == BASE.block_size
  for bad in (0, -1, True, 1.5):
    with pytest.raises(ValueError, match="query_limit must be a positive int or None"):
      BASE.replace(query_limit=bad)
  with pytest.raises(ValueError, match="query_limit is a mode of method 'd2f' / 'threshold', not 'vanilla'"):
    DecodeConfig(method="vanilla", block_size=4, max_new_tokens=16, query_limit=2)


def test_the_limit_is_a_knob_sweeping_it_never_recompiles():
  """Only switching the mode on compiles (the query-limited step); q itself is traced, so the engine can give
  each slot its own and a sweep reuses one program. A limit of a whole block in that program decodes the exact
  tokens."""
  from d2f_jax.decode import trace_count
  model = sharp_model("llada")
  config = BASE.replace(tau_conf=0.5, tau_add=0.25, tau_act=0.5)
  generate(model, PROMPTS, config.replace(query_limit=1))
  before = trace_count("loop")
  for q in (2, 3, config.block_size):
    result = generate(model, PROMPTS, config.replace(query_limit=q))
  assert trace_count("loop") == before
  exact = generate(model, PROMPTS, config)
  np.testing.assert_array_equal(np.asarray(result.trace), np.asarray(exact.trace))


def budget_reference(model, prompt, config):
  run = config.effective()
  return ref.d2f(model, prompt, block_size=run.block_size, max_new_tokens=run.max_new_tokens,
                 max_blocks_in_flight=run.max_blocks_in_flight, tau_add=run.tau_add, tau_act=run.tau_act,
                 tau_conf=run.tau_conf, stop_ids=_stops(model, run), query_limit=run.query_limit,
                 position_budget=run.position_budget)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_a_position_budget_narrows_the_windows_as_the_reference_does(family):
  """Alone (one row: the budget's sum is its own), each step's q is the largest halving of the block that
  fits the budget; a budget nothing reaches decodes the exact tokens."""
  model = sharp_model(family)
  config = BASE.replace(tau_conf=0.5, tau_add=0.0, tau_act=0.5)
  narrowed = False
  for budget in (4, 6, 9):
    budgeted = config.replace(position_budget=budget)
    for prompt in PROMPTS:
      result = generate(model, [prompt], budgeted)
      want = budget_reference(model, prompt, budgeted)
      assert_rows_match(result, [want], [prompt])
      narrowed |= bool((want["trace"] != d2f_reference(model, prompt, config)["trace"]).any())
  assert narrowed, "no budget narrowed a window: the test could not tell the budget from no budget"
  roomy = generate(model, PROMPTS, config.replace(position_budget=10 ** 6))
  exact = generate(model, PROMPTS, config)
  np.testing.assert_array_equal(np.asarray(roomy.trace), np.asarray(exact.trace))
  with pytest.raises(ValueError, match="position_budget is a mode of method 'd2f' / 'threshold', not 'ar'"):
    DecodeConfig(method="ar", max_new_tokens=8, position_budget=8)
