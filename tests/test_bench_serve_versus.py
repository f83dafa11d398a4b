"""`bench serve --versus ar` (d2f_jax/bench/serve/versus.py): every engine's answers checked against batch-1
decodes in its own mode, the rows' counts consistent with what the engines decoded."""

import argparse

import ml_collections

from d2f_jax.bench.serve import versus as serve_versus
from d2f_jax.decode import DecodeConfig
from test_decode import sharp_model

PROMPTS = [[11, 23, 5], [3, 14, 15, 92, 65, 35, 89, 79, 32], [2, 71, 82, 81], [99, 98]]


def test_the_modes_of_a_sweep_at_the_decode_block():
  c = ml_collections.ConfigDict({"mode_sweep": [(None, 8), (None, 4), (16, None), (16, 4), (32, 2), (None, 8),
                                                (None, 4, True), (16, None, True), (None, 4, False)]})
  assert serve_versus.modes_of(c, 32) == [(8, False), (4, False), (2, False), (4, True)]
  assert serve_versus.modes_of(c, 16) == [(8, False), (4, False), (4, True), (16, True)]
  assert serve_versus.modes_of(ml_collections.ConfigDict(), 16) == []


def test_every_engine_equals_its_batch_one_decodes_and_rows_add_up():
  model = sharp_model("llada")
  args = argparse.Namespace(prompt_bucket=8, steps_per_call=3, max_insert=2, repeats=1)
  config = DecodeConfig(method="d2f", block_size=4, max_new_tokens=16, tau_add=0.25, tau_act=0.5, tau_conf=0.5,
                        prompt_buckets=8)
  rows = serve_versus.run({"d2f": model, "ar": model}, {"d2f": PROMPTS, "ar": PROMPTS}, config, [2],
                          [(2, False), (2, True)], args)
  assert [r["engine"] for r in rows] == ["d2f exact", "d2f q=2", "d2f q=2 cached", "ar"]
  assert all(r["identical to batch 1"] and r["problems"] == len(PROMPTS) and r["slots"] == 2 for r in rows)
  exact, limited, cached, ar = rows
  assert cached["positions/token"] < limited["positions/token"], "keeping decided K/V feeds fewer positions"
  assert ar["vs ar"] == 1 and ar["tokens/forward"] == 1 and ar["positions/token"] == 1
  assert exact["tokens"] == sum(map(len, serve_versus._alone(model, PROMPTS, config)))
  assert exact["tokens/forward"] > 1 and exact["positions/token"] >= 1  # each accepted token fed at least once
  # q=2 feeds at most 2 masks a block in flight a step: fewer tokens per forward than the exact loop here.
  assert limited["tokens/forward"] < exact["tokens/forward"]
