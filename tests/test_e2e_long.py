"""The long-answer variant of the main job (configs/tiny_e2e.py:long): verbose worked solutions, a decode
block apart from the training block, the positions column of results.md, and the variant's smoke run; and
the pins that keep the default run's data as it was."""

import hashlib
import json
import pathlib
import re

import numpy as np
import pytest

from d2f_jax.e2e import evaluation, pipeline, report
from d2f_jax.tasks import arithmetic, tokenizer
from d2f_jax.tasks.arithmetic import ArithmeticTask
from test_e2e import _config

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "main_job_results.json"


def _ids(text: str) -> list[int]:
  return tokenizer.build_tokenizer()(text, add_special_tokens=False)["input_ids"]


def _sentences(text: str) -> list[str]:
  return re.split(r"(?<=[.?]) ", text)


def test_the_default_format_and_vocabulary_are_unchanged():
  """Pinned from before the verbose style: a problem's text and ids, the vocabulary, the held-out set."""
  p = arithmetic.make_problems(3, seed=0, min_steps=1, max_steps=2)[2]
  assert p.question == ("Sam has 19 books. Then the number doubles. Then buys 4 boxes with 5 books each. How many "
                        "books does Sam have now?")
  assert (p.solution, p.answer) == ("19 * 2 = 38. 4 * 5 = 20. 38 + 20 = 58. So the answer is 58.", 58)
  assert _ids(" " + p.solution) == [14, 32, 9, 15, 11, 16, 31, 5, 17, 9, 18, 11, 15, 23, 5, 16, 31, 7, 15, 23, 11,
                                    18, 31, 5, 71, 66, 72, 73, 18, 31, 5]
  assert _ids(arithmetic.prompt_text(p.question)) == [49, 37, 57, 14, 32, 45, 5, 51, 66, 67, 68, 5, 51, 62, 17, 63,
                                                      64, 18, 45, 65, 5, 52, 53, 45, 54, 37, 55, 56, 6, 50]
  vocab = tokenizer.vocabulary()
  digest = hashlib.sha256(json.dumps(vocab, sort_keys=True).encode()).hexdigest()
  assert (len(vocab), digest) == (74, "853aede1cff496fc3b555f01e0711b051274a33f715de047947f118352f5d9ce")
  first = ArithmeticTask().load(1)[0]
  assert first["prompt"] == ("Question Max has 7 books. Then gives away 3 books. Then gets 2 more books. How many "
                             "books does Max have now? Answer") and first["target"] == 6
  default = pipeline.data_identity(_config(None))  # a stage finished before task.style existed is still reused
  assert default["task"] == {"train": 30000, "test": 256, "min_steps": 1, "max_steps": 2}


def test_verbose_solutions_restate_every_step_around_the_terse_equations():
  terse = arithmetic.make_problems(60, seed=5, min_steps=4, max_steps=7)
  verbose = arithmetic.make_problems(60, seed=5, min_steps=4, max_steps=7, style="verbose")
  tok = tokenizer.build_tokenizer()
  unk = tok.convert_tokens_to_ids(tokenizer.UNK)
  for t, v in zip(terse, verbose, strict=True):
    assert (v.question, v.answer) == (t.question, t.answer)  # the same draws: only the solution differs
    assert arithmetic.extract_answer(v.solution) == v.answer
    encoded = tok(" " + v.solution, add_special_tokens=False)["input_ids"]
    assert unk not in encoded and tok.decode(encoded) == v.solution
    said = _sentences(v.solution)
    assert " ".join(s for s in said if "=" in s or s.startswith("So ")) == t.solution
    asked = _sentences(v.question)
    name, _, start, item = asked[0].rstrip(".").split(" ")
    assert said[0] == asked[0]
    restated = [s for s in said if "=" not in s and not s.startswith("So ")][1:]
    # Per step: the question's sentence, then (after its equations) the new state, the last equation's result.
    assert restated[0::2] == asked[1:-1]
    values = [int(s.split(" ")[2]) for s in restated[1::2]]
    assert restated[1::2] == [f"{name} has {n} {item}." for n in values] and values[-1] == v.answer
    results = [int(s.rstrip(".").split(" = ")[1]) for s in said if "=" in s]
    assert set(values) <= set(results)
  with pytest.raises(ValueError, match="style must be one of .*'wordy'"):
    arithmetic.make_problems(1, seed=0, style="wordy")


def test_the_long_variant_answers_average_120_tokens_and_fit_its_shapes():
  c = _config("long")
  task = pipeline.held_out_task(c)
  assert task.options()["style"] == "verbose" and len(task.load()) == c.task.test
  _, held_out = arithmetic.split(c.seed, c.task.train, c.task.test, min_steps=c.task.min_steps,
                                 max_steps=c.task.max_steps, style=c.task.style)
  answers = [len(_ids(" " + p.solution)) for p in held_out]
  prompts = [len(_ids(arithmetic.prompt_text(p.question))) for p in held_out]
  assert np.mean(answers) >= 120, np.mean(answers)
  assert max(answers) + 1 <= c.max_new_tokens  # every answer and its EOS fits the decode
  assert max(a + q for a, q in zip(answers, prompts)) + 1 <= c.seq_len
  assert [p["prompt"] for p in task.load(3)] == [arithmetic.prompt_text(p.question) for p in held_out[:3]]


def test_evaluate_scores_the_long_variants_held_out_set():
  """`python -m d2f_jax.evaluate --task arithmetic` takes the task's fields as flags, the help's :long line."""
  from d2f_jax import evaluate
  parser = evaluate.build_parser()
  flags = ["--model", "m", "--task", "arithmetic", "--arithmetic_min_steps", "4", "--arithmetic_max_steps", "7",
           "--arithmetic_test", "64", "--arithmetic_style", "verbose"]
  assert evaluate.make_task(parser.parse_args(flags)).options() == pipeline.held_out_task(_config("long")).options()
  assert evaluate.make_task(parser.parse_args(flags[:4])).options() == pipeline.held_out_task(_config(None)).options()
  with pytest.raises(SystemExit, match="--arithmetic_test only apply to --task arithmetic, not --task gsm8k"):
    evaluate.make_task(parser.parse_args(["--model", "m", "--task", "gsm8k", "--arithmetic_test", "3"]))


def test_the_decode_block_is_apart_from_the_training_block():
  c = _config("long")
  assert (c.block_size, evaluation.decode_block_size(c), c.max_new_tokens) == (16, 32, 256)
  config = pipeline.stage_config(c, objective="distill", data_path="d", tokenizer_dir="t", steps=4, lr=1e-3, warmup=1)
  assert config.block_size == 16  # distilled at the authors' training block ...
  rows = evaluation.decode_rows(c, {"teacher": None, "student": None, "ar": None})
  modes = [dc for _, _, settings, dc in rows if "block=" in settings or " q=" in settings or "cached" in settings]
  assert {(dc.block_size, dc.max_new_tokens) for _, _, _, dc in rows if dc not in modes} == {(32, 256)}  # theirs
  # ... and the throughput-mode rows: sub-blocks of 8 / 4 at block 32, the training block 16 with and without,
  # the cache of decided positions alone and with sub-blocks of 8 / 4.
  assert [(dc.block_size, dc.query_limit, dc.cache_decided) for dc in modes] == [
      (32, 8, False), (32, 4, False), (16, None, False), (16, 4, False), (32, None, True), (32, 8, True),
      (32, 4, True)]
  assert all((dc.tau_add, dc.tau_act, dc.tau_conf) == (0.1, 0.95, 0.9) for dc in modes)
  default = _config(None)
  assert default.decode_block_size is None
  assert {dc.block_size for _, _, _, dc in evaluation.decode_rows(default, {"teacher": None})} == {8}
  pipeline.check_config(c)
  c.max_new_tokens = 240
  with pytest.raises(pipeline.ConfigError, match=r"config.max_new_tokens \(240\) must be a multiple of the decode "
                                                 r"block \(32: config.decode_block_size"):
    pipeline.check_config(c)
  c.max_new_tokens, c.task.style = 256, "wordy"
  with pytest.raises(pipeline.ConfigError, match="config.task.style must be one of .*'wordy'"):
    pipeline.check_config(c)


def test_results_md_shows_positions_computed_per_accepted_token(tmp_path):
  rows = json.loads(FIXTURE.read_text())["rows"]
  report.write_results(str(tmp_path), rows, {}, {"block_size": 8, "max_new_tokens": 40})
  text = (tmp_path / "results.md").read_text()
  assert "block 8, at most 40 new tokens." in text  # the default run's sentence, unchanged
  table = text.split("```")[1].strip().splitlines()
  titles = [cell.strip() for cell in table[0].split("|")]
  column = titles.index("positions computed per accepted token")
  assert titles[column - 1] == "window blocks"
  cells = [line.split("|")[column].strip() for line in table[2:]]
  # window blocks x block / tokens per forward; vanilla: (26 prompt + 40 new) / 0.57; AR: 1
  by_method = {(r["method"], r["settings"]): r["positions_per_token"] for r in rows}
  assert by_method[("d2f", "add=0.1 act=0.95 conf=0.9")] == pytest.approx(2.76 * 8 / 3.85)
  assert by_method[("threshold", "tau_conf=0.9")] == pytest.approx(1.88 * 8 / 2.56)
  assert by_method[("vanilla", "LLaDA semi-AR, 40 steps")] == pytest.approx((26 + 40) / 0.57)
  assert by_method[("ar", "KV cache")] == 1.0
  assert cells == [f"{r['positions_per_token']:.2f}" for r in rows] and cells[-1] == "1.00"
  # Decoded at block 32 (trained at 16): a window block holds 32 positions.
  report.write_results(str(tmp_path), rows, {}, {"block_size": 16, "decode_block_size": 32, "max_new_tokens": 256})
  assert "block 32 (distilled at block 16), at most 256 new tokens." in (tmp_path / "results.md").read_text()
  d2f = next(r for r in rows if r["settings"] == "add=0.1 act=0.95 conf=0.9")
  assert d2f["positions_per_token"] == pytest.approx(2.76 * 32 / 3.85)


def test_long_smoke_run_trains_at_block_16_and_decodes_at_block_32(tmp_path):
  """The variant end to end in miniature: verbose training rows, block-16 distillation, block-32 decoding."""
  c = _config("long,smoke")
  payload = pipeline.run(c, str(tmp_path))
  tokens, prompt_len = np.load(tmp_path / "data" / "train.npz").values()
  tok = tokenizer.build_tokenizer()
  first = tok.decode([t for t in tokens[0][prompt_len[0]:] if t != tokenizer.special_ids()["eos_token_id"]])
  assert first == arithmetic.split(c.seed, c.task.train, c.task.test, min_steps=4, max_steps=7,
                                   style="verbose")[0][0].solution
  done = json.loads((tmp_path / "student" / "stage_done.json").read_text())
  assert done["config"]["block_size"] == 16 and done["config"]["data_source.task.style"] == "verbose"
  rows = payload["rows"]
  assert [r["method"] for r in rows] == ["vanilla", "dream_vanilla", "threshold"] + ["d2f"] * 5 + ["ar"]
  for row in rows:
    block = 16 if "block=16" in row["settings"] else 32  # the throughput mode at the training block
    assert (row["decode"]["block_size"], row["decode"]["max_new_tokens"]) == (block, 64)  # 256 outside the smoke
    assert row["total"] == c.task.test and row["positions_per_token"] > 0
    if row["method"] in ("d2f", "threshold"):
      assert 1.0 <= row["mean_in_flight"] <= row["mean_window_blocks"] <= 64 // block
      assert 0 < row["mean_window_positions"] <= row["mean_window_blocks"] * block
  q4 = [r for r in rows if r["settings"].endswith(" q=4")]
  assert [r["decode"]["query_limit"] for r in q4] == [4, 4] and all("ceiling_vs_ar" in r for r in q4)
  cached = [r for r in rows if r["settings"].endswith(" q=4 cached")]
  assert len(cached) == 1 and cached[0]["decode"]["cache_decided"] and "ceiling_vs_ar" in cached[0]
  assert payload["ceiling"]["prompt_width"] == 64  # the bucket of the mean prompt (about 53 tokens)
  markdown = (tmp_path / "results.md").read_text()
  assert "block 32 (distilled at block 16), at most 64 new tokens." in markdown
  assert "positions computed per accepted token" in markdown


def test_the_committed_long_results_are_the_variants_run():
  """results/tiny_e2e_long/results.json (what `bench cost --frontier` projects without retraining) ran with the
  config `configs/tiny_e2e.py:long` gives today, every mode of its sweep among its rows, each d2f / threshold
  row's window measured at batch 1 and at batch 32; a changed variant must be rerun and committed again."""
  path = pathlib.Path(__file__).parent.parent / "results" / "tiny_e2e_long" / "results.json"
  payload = json.loads(path.read_text())
  today = json.loads(json.dumps(_config("long").to_dict()))
  assert payload["config"] == today
  settings = [row["settings"] for row in payload["rows"]]
  assert sum(s.endswith("cached") for s in settings) == 3 and len(settings) == 14, settings
  exact = [r for r in payload["rows"] if r["method"] == "d2f" and r["decode"]["query_limit"] is None
           and not r["decode"].get("cache_decided") and r["decode"]["block_size"] == 32]
  assert exact and all(r["total"] == 64 for r in payload["rows"])
  for row in payload["rows"]:
    if row["method"] in ("d2f", "threshold"):
      assert row["window_at_batch"]["32"]["mean_window_positions"] >= row["mean_window_positions"] > 0
