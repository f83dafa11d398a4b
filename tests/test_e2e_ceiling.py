"""The main job's CPU ceiling (e2e/ceiling.py) and its place in results.md, on the README's main-job table as a
fixture (the main job itself is not re-run here; test_e2e's smoke run goes through the same code)."""

import json
import pathlib
import types

from flax import nnx

from d2f_jax.api import Model
from d2f_jax.decode.widths import ms_at_width
from d2f_jax.e2e import ceiling, report
from d2f_jax.models import Transformer, preset

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "main_job_results.json"


def _rows():
  return json.loads(FIXTURE.read_text())["rows"]


def test_ceiling_times_the_steps_on_the_run_models_and_sets_each_d2f_row():
  model = Model.from_module(Transformer(preset("tiny-dream"), rngs=nnx.Rngs(0)))
  c = types.SimpleNamespace(max_new_tokens=32, block_size=8)
  rows = _rows()
  steps = ceiling.add_ceiling(rows, {"student": model, "ar": model}, c, repeats=3)
  assert sorted(steps["d2f_step_ms"]) == [2, 3]  # around the fixture's mean windows 2.47-2.76
  assert steps["ar_step_ms"] > 0 and all(ms > 0 for ms in steps["d2f_step_ms"].values())
  for row in rows:
    if row["method"] != "d2f":
      assert "ceiling_vs_ar" not in row
      continue
    at = ms_at_width(steps["d2f_step_ms"], row["mean_window_blocks"])
    assert row["ceiling_vs_ar"] == row["tokens_per_forward"] * steps["ar_step_ms"] / at
  assert ceiling.add_ceiling(rows, {"student": model}, c) == {}  # no AR model: no ceiling


def test_results_md_shows_the_ceiling_beside_the_measured_ratio(tmp_path):
  rows = _rows()
  steps = {"ar_step_ms": 0.41, "d2f_step_ms": {2: 0.9, 3: 1.05}, "repeats": 200, "prompt_width": 64}
  for row in rows:
    if row["method"] == "d2f":
      row["step_ms_at_width"] = ms_at_width(steps["d2f_step_ms"], row["mean_window_blocks"])
      row["ceiling_vs_ar"] = row["tokens_per_forward"] * steps["ar_step_ms"] / row["step_ms_at_width"]
  payload = report.write_results(str(tmp_path), rows, {}, {"block_size": 8, "max_new_tokens": 40}, steps)
  assert payload["ceiling"] == steps
  text = (tmp_path / "results.md").read_text()
  assert "CPU ceiling vs AR" in text and "## CPU ceiling of D2F over AR (measured in this run)" in text
  # 3.85 x 0.41 / (0.9 + 0.76 x 0.15) = 1.56: the paper setting's ceiling beside its measured 1.05x
  assert "window 2.76 blocks = 1.014 ms -> ceiling 1.56x AR; measured 1.05x" in text
  table = text.split("```")[1]
  d2f_line = next(line for line in table.splitlines() if "add=0.1" in line)
  cells = [cell.strip() for cell in d2f_line.split("|")]
  assert cells[cells.index("1.05x") + 1] == "1.56x"  # the ceiling column sits right of the measured vs AR
