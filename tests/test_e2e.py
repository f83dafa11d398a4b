"""The built-in arithmetic task, its tokenizer, and the miniature reproduction run end to end."""

import importlib.util
import json
import pathlib

import numpy as np
import pytest

from d2f_jax.e2e import data as e2e_data
from d2f_jax.tasks import arithmetic, tokenizer

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _config(arg):
  spec = importlib.util.spec_from_file_location("tiny_e2e", ROOT / "configs" / "tiny_e2e.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def test_problems_are_deterministic_and_checkable():
  a, b = arithmetic.make_problems(50, seed=3), arithmetic.make_problems(50, seed=3)
  assert a == b and a != arithmetic.make_problems(50, seed=4)
  for p in a:
    assert arithmetic.extract_answer(p.solution) == p.answer
    # The worked solution is consistent: every "x op y = z" step holds.
    for step in p.solution.split(". "):
      if "=" in step:
        lhs, rhs = step.rstrip(".").split(" = ")
        assert eval(lhs.replace("/", "//")) == int(rhs), step
  train, test = arithmetic.split(0, 200, 20)
  assert len(train) == 200 and len(test) == 20
  assert not {p.question for p in train} & {p.question for p in test}


@pytest.mark.parametrize("text, expected", [("4 + 5 = 9. So the answer is 9.", 9), ("So the answer is 12", 12),
                                            ("the answer is x.", None), ("no answer", None),
                                            ("The answer is 3. So the answer is 41.", 41)])
def test_extract_answer(text, expected):
  assert arithmetic.extract_answer(text) == expected


def test_tokenizer_round_trips_every_problem():
  tok = tokenizer.build_tokenizer()
  ids = tokenizer.special_ids()
  assert tok.convert_tokens_to_ids(tokenizer.MASK) == ids["mask_token_id"]
  assert tok.eos_token_id == ids["eos_token_id"] == ids["pad_token_id"]
  unk = tok.convert_tokens_to_ids(tokenizer.UNK)
  for p in arithmetic.make_problems(300, seed=1):
    for text in (arithmetic.prompt_text(p.question), p.solution):
      encoded = tok(text, add_special_tokens=False)["input_ids"]
      assert unk not in encoded
      assert tok.decode(encoded) == text
  assert tok("12 + 305")["input_ids"] == tok.convert_tokens_to_ids(["1", "##2", "+", "3", "##0", "##5"])


def test_encode_rows_pads_with_eos_and_refuses_overflow():
  problems = arithmetic.make_problems(8, seed=0)
  tokens, prompt_len = e2e_data.encode_rows(problems, seq_len=128)
  eos = tokenizer.special_ids()["eos_token_id"]
  tok = tokenizer.build_tokenizer()
  for row, n, p in zip(tokens, prompt_len, problems):
    assert tok.decode(row[:n]) == arithmetic.prompt_text(p.question)
    text = tok.decode([t for t in row[n:] if t != eos])
    assert text == p.solution and row[-1] == eos
  with pytest.raises(ValueError, match="raise data.seq_len"):
    e2e_data.encode_rows(problems, seq_len=20)


def test_smoke_run_writes_every_artefact_and_resumes(tmp_path):
  """The Dream-layout recipe end to end (AR pre-training -> MDM adaptation with shifted logits -> D2F)."""
  from d2f_jax.e2e import pipeline
  c = _config("smoke")
  payload = pipeline.run(c, str(tmp_path))
  rows = payload["rows"]
  assert [(r["method"], r["role"]) for r in rows] == (
      [("vanilla", "teacher"), ("dream_vanilla", "teacher"), ("threshold", "teacher")]
      + [("d2f", "student")] * len(c.d2f_sweep) + [("ar", "ar")])
  for row in rows:
    assert row["total"] == c.task.test and 0.0 <= row["accuracy"] <= 100.0
    assert row["timed_seconds"] > 0 and row["harness_tokens_per_s"] > 0  # the interleaved pass timed the row
    assert row["stderr"] >= 0.0 and row["ms_per_forward"] > 0
    assert row["tokens_per_forward"] is None or row["tokens_per_forward"] > 0
    if row["method"] in ("d2f", "threshold"):
      assert 1.0 <= row["mean_in_flight"] <= row["mean_window_blocks"] <= c.max_new_tokens // c.block_size
      # a batch's forward is as wide as its widest live row, never narrower than a row's own (batch 1) window
      batched = row["window_at_batch"]["32"]
      assert batched["mean_window_positions"] >= row["mean_window_positions"]
      assert batched["mean_in_flight"] == pytest.approx(row["mean_in_flight"])  # blocks in flight are the row's own
    else:
      assert row["mean_window_positions"] is None and row["window_at_batch"] == {"32": {}}
  assert [p["method"] for p in payload["projection"]] == [r["method"] for r in rows]
  saved = json.loads((tmp_path / "results.json").read_text())
  assert saved["rows"] == json.loads(json.dumps(rows, default=str))
  assert set(saved["stages"]) == {"ar", "teacher", "student"}
  markdown = (tmp_path / "results.md").read_text()
  for text in ("tokens/fwd", "vs AR", "blocks in flight", "ms/fwd", "+-", "Projection (not a measurement)",
               "token-level", "workdir/<stage>/hf"):
    assert text in markdown, text
  for picture in ("throughput_vs_accuracy.png", "decode_trace.png"):
    assert (tmp_path / picture).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  for stage, kind in (("teacher", "bidirectional"), ("ar", "causal"), ("student", "block_causal")):
    hf = json.loads((tmp_path / stage / "hf" / "config.json").read_text())
    assert hf["d2f_attention"] == kind and (tmp_path / stage / "hf" / "tokenizer.json").exists()
  teacher_config = json.loads((tmp_path / "teacher" / "hf" / "config.json").read_text())
  assert teacher_config["model_type"] == "Dream"  # spelled as in Dream-org/Dream-v0-Base-7B's config.json
  # A second run skips the finished stages and reproduces the accuracies (greedy decoding).
  again = pipeline.run(c, str(tmp_path))
  assert all(stage.pop("skipped") for stage in again["stages"].values())
  assert again["stages"] == json.loads(json.dumps(payload["stages"]))  # the first run's summaries, kept
  assert [r["accuracy"] for r in again["rows"]] == [r["accuracy"] for r in rows]

  # `evaluate --task arithmetic` scores the main job's held-out task (not HumanEval) ...
  from d2f_jax import evaluate
  from d2f_jax.tasks.arithmetic import ArithmeticTask
  out = tmp_path / "eval_arith"
  results = evaluate.main(["--model", str(tmp_path / "student" / "hf"), "--task", "arithmetic", "--limit", "2",
                           "--block_size", str(c.block_size), "--max_new_tokens", str(c.max_new_tokens),
                           "--out", str(out), "--warmup", "none"])
  assert results["task"] == "arithmetic" and results["total"] == 2
  samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
  assert [s["id"] for s in samples] == [item["id"] for item in ArithmeticTask().load(2)]
  # ... and a method the model cannot decode is refused, naming it.
  with pytest.raises(SystemExit, match="does not fit.*trained causally"):
    evaluate.main(["--model", str(tmp_path / "ar" / "hf"), "--task", "arithmetic", "--limit", "1",
                   "--out", str(tmp_path / "bad")])
  with pytest.raises(SystemExit, match="needs a causal model"):
    evaluate.main(["--model", str(tmp_path / "teacher" / "hf"), "--task", "arithmetic", "--method", "ar",
                   "--limit", "1", "--out", str(tmp_path / "bad")])

  # `bench serve` on the trained student: the engine and static batches time the same problems, and the
  # engine's tokens are checked equal to generate's (bench serve exits non-zero when they differ).
  from d2f_jax.bench import serve as bench_serve
  report = tmp_path / "bench_serve.json"
  bench_serve.main(["--workdir", str(tmp_path), "--config", "configs/tiny_e2e.py:smoke", "--slots", "2",
                    "--limit", "3", "--repeats", "1", "--json", str(report)])
  [row] = json.loads(report.read_text())["rows"]
  assert row["slots"] == 2 and row["problems"] == 3 and row["identical"] is True and row["tokens"] > 0


def test_interleaved_timing_rotates_the_rows_and_counts(monkeypatch):
  """Every prompt is decoded by every row, starting one row later each prompt; tokens and forwards add up;
  a call that compiled (row a's first) is timed again."""
  from d2f_jax.e2e import evaluation
  order, traces = [], [0]

  class Result:
    def __init__(self, n):
      self.n, self.forwards = n, np.array([n + 1])
      self.in_flight_sum, self.window_sum, self.position_sum = np.array([n]), np.array([2 * n]), np.array([3 * n])

    def to_lists(self):
      return [[0] * self.n]

  def fake_generate(model, prompts, config):
    if not order:
      traces[0] += 1  # the first call compiles
    order.append((model, len(prompts[0])))
    return Result(len(prompts[0]))

  monkeypatch.setattr(evaluation, "generate", fake_generate)
  monkeypatch.setattr(evaluation, "trace_count", lambda name: traces[0])
  prompts = [[1], [2, 2], [3, 3, 3]]
  totals = evaluation.interleaved_timing([("a", None, prompts), ("b", None, prompts), ("c", None, prompts)])
  assert order == [("a", 1), ("a", 1), ("b", 1), ("c", 1), ("b", 2), ("c", 2), ("a", 2), ("c", 3), ("a", 3),
                   ("b", 3)]
  assert [(t["tokens"], t["forwards"]) for t in totals] == [(6, 9)] * 3
  assert [(t["in_flight"], t["window"], t["positions"]) for t in totals] == [(6, 12, 18)] * 3  # the retimed call once
  assert all(t["seconds"] > 0 for t in totals)
