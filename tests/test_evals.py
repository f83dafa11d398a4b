"""Evaluation harness: GSM8K prompts and answers, HumanEval post-processing, the runner end to end."""

import gzip
import json

import pytest

from d2f_jax.evals import gsm8k, humaneval
from d2f_jax.datafiles import read_jsonl
from d2f_jax.models import TINY_LLADA


# --- GSM8K answers ---------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("#### 72", "72"),
    ("She pays 3 * 4 = 12 dollars.\n#### 12\nQuestion: what is 99?", "12"),
    ("The answer is 18.", "18"),
    ("So the final answer is $1,234.50.", "1234.5"),
    ("It costs $1,234.50", "1234.5"),
    ("The temperature drops to -7 degrees.", "-7"),
    ("He owes $-3 now", "-3"),
    ("First 5, then 12, and finally 40", "40"),
    ("5-3=2", "2"),  # a minus between numbers is subtraction, not a sign
    ("It is 18.00", "18"),
    ("#### 1,000,000", "1000000"),
    ("The answer is: **42**", "42"),
    ("half of it is .5", "0.5"),
    ("no number here", None),
    ("", None),
])
def test_extract_answer(text, expected):
  assert gsm8k.extract_answer(text) == expected


def test_normalized_numbers_compare_equal():
  assert gsm8k.normalize_number("18.00") == gsm8k.normalize_number("18") == "18"
  assert gsm8k.normalize_number("$1,234.50") == gsm8k.normalize_number("1234.5") == "1234.5"
  assert gsm8k.normalize_number("-0") == "0"
  assert gsm8k.normalize_number("0.10") == "0.1"
  assert gsm8k.normalize_number("twelve") is None


def test_gold_answer_needs_the_hash_line():
  assert gsm8k.gold_answer("3 + 4 = 7\n#### 7") == "7"
  with pytest.raises(ValueError, match="x.jsonl:3.*####"):
    gsm8k.gold_answer("it is 7", where="x.jsonl:3")


def test_truncate_stops_at_the_next_question():
  text = " 2 + 2 = 4\n#### 4\n\nQuestion: Tom has 9 apples\nAnswer: #### 9"
  assert gsm8k.truncate(text) == "2 + 2 = 4\n#### 4"
  assert gsm8k.extract_answer(gsm8k.truncate(text)) == "4"


# --- GSM8K data and prompts ------------------------------------------------------------------------

def _write_jsonl(path, rows, raw_lines=()):
  with open(path, "w") as f:
    for row in rows:
      f.write(json.dumps(row) + "\n")
    for line in raw_lines:
      f.write(line + "\n")
  return str(path)


SMALL = [{"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"} for i in range(1, 6)]


@pytest.mark.real_data("gsm8k_test.jsonl")
def test_loader_reads_the_real_test_split():
  items = gsm8k.Gsm8kTask().load()  # from the data directory, as a user's default run reads it
  assert len(items) == 1319
  assert items[0]["id"] == "gsm8k/0" and items[0]["target"] == "18"
  assert len({item["id"] for item in items}) == 1319
  assert all(item["prompt"].endswith("\nAnswer:") for item in items[:5])


def test_loader_reads_the_data_directory(fixture_data_dir, monkeypatch):
  """The default path is the data directory's gsm8k_test.jsonl: worked steps with <<a*b=c>> notes and
  '#### N' answers written with a comma, a minus sign or a decimal point."""
  monkeypatch.setenv("D2F_DATA_DIR", str(fixture_data_dir))
  items = gsm8k.Gsm8kTask().load()
  assert [item["id"] for item in items] == [f"gsm8k/{i}" for i in range(8)]
  assert [item["target"] for item in items] == ["19", "45", "1625", "-7", "3.5", "78", "72", "390"]
  assert all(item["prompt"].endswith("\nAnswer:") and item["prompt"].count("Question:") == 5 for item in items)
  assert gsm8k.Gsm8kTask().options()["path"] == str(fixture_data_dir / "gsm8k_test.jsonl")


def test_fixture_files_are_what_their_generator_writes(fixture_data_dir):
  import sys
  sys.path.insert(0, str(fixture_data_dir.parent))
  try:
    import benchmark_data
  finally:
    sys.path.remove(str(fixture_data_dir.parent))
  for name, content in benchmark_data.expected_files().items():
    assert (fixture_data_dir / name).read_bytes() == content, f"run python tests/fixtures/benchmark_data.py ({name})"


def test_loader_reads_any_file_with_the_same_fields(tmp_path):
  path = _write_jsonl(tmp_path / "small.jsonl", SMALL)
  items = gsm8k.Gsm8kTask(path=path, n_shot=2).load(limit=3)
  assert [item["target"] for item in items] == ["2", "4", "6"]
  gz = tmp_path / "small.jsonl.gz"
  with gzip.open(gz, "wt") as f:
    f.write("\n".join(json.dumps(r) for r in SMALL) + "\n\n")  # trailing blank line is skipped
  assert len(gsm8k.Gsm8kTask(path=str(gz)).load()) == 5


def test_bad_jsonl_names_the_file_and_line(tmp_path):
  path = _write_jsonl(tmp_path / "bad.jsonl", SMALL[:1], ['{"question": "q", "answer": '])
  with pytest.raises(ValueError, match=r"bad\.jsonl:2: not valid JSON"):
    gsm8k.Gsm8kTask(path=path).load()
  path = _write_jsonl(tmp_path / "missing.jsonl", SMALL[:2] + [{"question": "q"}])
  with pytest.raises(ValueError, match=r"missing\.jsonl:3: missing field 'answer'"):
    gsm8k.Gsm8kTask(path=path).load()
  path = _write_jsonl(tmp_path / "type.jsonl", [{"question": 3, "answer": "#### 3"}])
  with pytest.raises(ValueError, match=r"type\.jsonl:1: field 'question' must be a string"):
    read_jsonl(path, gsm8k.FIELDS)
  with pytest.raises(FileNotFoundError, match="nope.jsonl"):
    gsm8k.Gsm8kTask(path=str(tmp_path / "nope.jsonl")).load()


def test_few_shot_prompt_structure():
  prompt = gsm8k.build_prompt("How many legs do 3 cats have?", n_shot=4)
  blocks = prompt.split("\n\n")
  assert len(blocks) == 5
  for (question, answer), block in zip(gsm8k.BUILTIN_EXEMPLARS, blocks[:4]):
    assert block == f"Question: {question}\nAnswer: {answer}"
    assert gsm8k.extract_answer(answer) == answer.rsplit("#### ", 1)[1]  # exemplars follow the format
  assert blocks[4] == "Question: How many legs do 3 cats have?\nAnswer:"
  assert gsm8k.build_prompt("Q?", n_shot=0) == "Question: Q?\nAnswer:"
  with pytest.raises(ValueError, match="n_shot"):
    gsm8k.build_prompt("Q?", n_shot=len(gsm8k.BUILTIN_EXEMPLARS) + 1)


def test_exemplars_from_the_evaluated_file_are_left_out(tmp_path):
  path = _write_jsonl(tmp_path / "small.jsonl", SMALL)
  task = gsm8k.Gsm8kTask(path=path, n_shot=2, fewshot_path=path, fewshot_seed=0)
  items = task.load()
  assert len(items) == 3
  shots = items[0]["prompt"].split("\n\n")[:2]
  asked = {item["question"] for item in items}
  assert all(shot.split("\n")[0].removeprefix("Question: ") not in asked for shot in shots)


def test_gsm8k_scoring(tmp_path):
  task = gsm8k.Gsm8kTask(path=_write_jsonl(tmp_path / "small.jsonl", SMALL), n_shot=0)
  items = task.load(limit=2)
  records = task.score(items, [" 1 + 1 = 2\n#### 2.00\n\nQuestion: What is 5 + 5?\nAnswer: #### 10",
                               " The answer is 5."])
  assert [r["correct"] for r in records] == [True, False]
  assert records[0]["extracted"] == "2" and records[1]["extracted"] == "5" and records[1]["target"] == "4"


# --- HumanEval processing --------------------------------------------------------------------------

@pytest.mark.real_data("HumanEval.jsonl.gz")
def test_humaneval_loader_reads_the_real_file():
  problems = humaneval.load_problems()
  assert len(problems) == 164 and problems[0]["task_id"] == "HumanEval/0"
  assert set(humaneval.FIELDS) <= set(problems[0])


def test_humaneval_loader_reads_the_data_directory(fixture_data_dir, monkeypatch):
  monkeypatch.setenv("D2F_DATA_DIR", str(fixture_data_dir))
  problems = humaneval.load_problems()
  assert [p["task_id"] for p in problems] == [f"Fixture/{i}" for i in range(6)]
  assert all(set(humaneval.FIELDS) <= set(p) for p in problems)
  assert [p["task_id"] for p in humaneval.load_problems(limit=2)] == ["Fixture/0", "Fixture/1"]


@pytest.mark.parametrize("generation, expected", [
    ("    return a + b\n\ndef other():\n    pass\n", "    return a + b\n"),
    ("    return a + b\n\n\nif __name__ == '__main__':\n    print(f(1, 2))\n", "    return a + b\n"),
    ("    x = a\n    return x + b\nprint(f(1, 2))\n", "    x = a\n    return x + b\n"),
    ("    return a + b\nclass Extra:\n    pass\n", "    return a + b\n"),
    ("    return a + b\n# tests\nassert f(1, 2) == 3\n", "    return a + b\n"),
    ("```python\n    return a + b\n```\nThis adds the numbers.", "    return a + b\n"),
    ("Here is the function:\n```python\nimport math\n\ndef f(a, b):\n    return math.fsum([a, b])\n\n"
     "print(f(1, 2))\n```\n", "import math\n\ndef f(a, b):\n    return math.fsum([a, b])\n"),
    ("def helper(x):\n    return x\n\ndef f(a, b):\n    return helper(a) + b\n\ndef g():\n    pass\n",
     "def helper(x):\n    return x\n\ndef f(a, b):\n    return helper(a) + b\n"),
    ("```py\ndef f(a, b):\n    return a + b", "def f(a, b):\n    return a + b\n"),  # unclosed fence
])
def test_truncate_completion(generation, expected):
  assert humaneval.truncate_completion(generation, "f") == expected


def test_full_function_completion_runs_after_the_prompt(fixture_data_dir):
  problem = humaneval.load_problems(str(fixture_data_dir / "HumanEval.jsonl.gz"), limit=1)[0]
  body = problem["canonical_solution"]  # count_above, whose prompt imports List from typing
  generation = (f"```python\ndef {problem['entry_point']}(numbers: List[float], limit: float) -> int:\n"
                f"{body}```\nDone.")
  completion = humaneval.truncate_completion(generation, problem["entry_point"])
  program = humaneval.build_program(problem, completion)
  assert program.startswith(problem["prompt"].rstrip("\n") + "\n    pass\n")
  task = humaneval.HumanEvalTask(workers=1, sandbox=_sandbox())
  item = {"id": problem["task_id"], "prompt": problem["prompt"], "problem": problem}
  records = task.score([item, item, item], [generation, body + "\nprint('junk')\n", "    return None\n"])
  assert [r["correct"] for r in records] == [True, True, False]
  assert records[2]["status"] == "failed" and records[2]["reason"]


def _sandbox(**limits):
  """The bubblewrap sandbox, or the explicit process fallback on hosts without namespaces (warned)."""
  import warnings

  from d2f_jax.evals.sandbox import Sandbox, bubblewrap_unavailable_reason
  if bubblewrap_unavailable_reason() is None:
    return Sandbox(**limits)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    return Sandbox(isolation="process", **limits)


# --- runner end to end -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  from d2f_jax.convert.synthetic import write_hf_checkpoint
  return write_hf_checkpoint(tmp_path_factory.mktemp("tiny_llada_eval"), TINY_LLADA, seed=0, dtype="float32")


def _read_samples(path):
  with open(path) as f:
    return [json.loads(line) for line in f]


def test_cli_gsm8k_end_to_end(checkpoint, tmp_path, fixture_data_dir):
  from d2f_jax import evaluate
  out = tmp_path / "gsm8k"
  data = str(fixture_data_dir / "gsm8k_test.jsonl")
  results = evaluate.main(["--model", checkpoint, "--task", "gsm8k", "--data", data, "--limit", "2", "--n_shot", "1",
                           "--block_size", "8", "--max_new_tokens", "16", "--max_blocks_in_flight", "2",
                           "--out", str(out)])
  with open(out / "results.json") as f:
    saved = json.load(f)
  assert saved["task"] == "gsm8k" and saved["metric"] == "exact_match" and saved["total"] == 2
  assert 0.0 <= saved["score"] <= 100.0 and saved["score"] == results["score"]
  assert saved["decode"]["method"] == "d2f" and saved["decode"]["block_size"] == 8
  assert saved["settings"]["batch_size"] == 1 and saved["task_options"]["n_shot"] == 1
  assert saved["task_options"]["path"] == data
  speed = saved["speed"]
  assert speed["warmup"]["batches"] >= 1 and speed["warmup"]["compiled_batches_in_timing"] == 0
  assert 0 < speed["tokens"] <= 2 * 16 and speed["forwards"] > 0
  assert speed["tokens_per_s"] > 0 and 0 < speed["tokens_per_forward"] <= 8 and speed["latency_s_mean"] > 0
  samples = _read_samples(out / "samples.jsonl")
  assert [s["id"] for s in samples] == ["gsm8k/0", "gsm8k/1"]
  for s in samples:
    assert {"generation", "kept", "extracted", "target", "correct", "tokens", "forwards", "latency_s"} <= set(s)
    assert isinstance(s["correct"], bool) and 0 < s["tokens"] <= 16


def test_runner_humaneval_batched(checkpoint, tmp_path, fixture_data_dir):
  import d2f_jax
  from d2f_jax.decode import DecodeConfig
  from d2f_jax.evals import make_task, run_benchmark

  model = d2f_jax.load_model(checkpoint)
  task = make_task("humaneval", path=str(fixture_data_dir / "HumanEval.jsonl.gz"), sandbox=_sandbox(timeout_s=5.0),
                   workers=2)
  config = DecodeConfig(method="d2f", block_size=8, max_new_tokens=16, max_blocks_in_flight=2, prompt_buckets=256)
  results = run_benchmark(model, task, config, batch_size=2, limit=2, out_dir=str(tmp_path), log=None)
  assert results["metric"] == "pass@1" and results["total"] == 2 and results["correct"] == 0
  assert results["settings"]["batch_size"] == 2 and results["task_options"]["sandbox"]["timeout_s"] == 5.0
  assert results["task_options"]["sandbox"]["isolation"] == task.sandbox.isolation  # recorded in results.json
  samples = _read_samples(tmp_path / "samples.jsonl")
  assert [s["id"] for s in samples] == ["Fixture/0", "Fixture/1"]
  assert all(s["status"] in ("failed", "timeout") and s["batch"] == 0 for s in samples)
  assert results["speed"]["engine"] is True  # batch > 1 with d2f: through the continuous-batching engine


def test_batched_evaluation_through_the_engine_equals_batch_one(checkpoint, tmp_path):
  """batch_size 3 feeds the problems through a 3-slot engine: every generation, token count and forward
  count equals the batch-1 run's (a 4x head keeps the random model's greedy choices clear of near-ties)."""
  import d2f_jax
  from d2f_jax.api import Model
  from d2f_jax.decode import DecodeConfig
  from d2f_jax.evals import run_benchmark
  from d2f_jax.tasks.arithmetic import ArithmeticTask

  loaded = d2f_jax.load_model(checkpoint)
  module = loaded.module
  module.lm_head[...] = module.lm_head[...] * 4.0
  model = Model.from_module(module, loaded.tokenizer)
  task = ArithmeticTask(seed=0, train=8, test=5)
  config = DecodeConfig(method="d2f", block_size=8, max_new_tokens=16, tau_conf=0.5, tau_add=0.25, tau_act=0.5)
  one = run_benchmark(model, task, config, batch_size=1, log=None, warmup="none", out_dir=str(tmp_path / "1"))
  three = run_benchmark(model, task, config, batch_size=3, log=None, warmup="first", out_dir=str(tmp_path / "3"))
  assert one["speed"]["engine"] is False and three["speed"]["engine"] is True
  assert one["score"] == three["score"] and one["speed"]["tokens"] == three["speed"]["tokens"] > 0
  for a, b in zip(_read_samples(tmp_path / "1" / "samples.jsonl"), _read_samples(tmp_path / "3" / "samples.jsonl")):
    assert (a["generation"], a["tokens"], a["forwards"]) == (b["generation"], b["tokens"], b["forwards"]), a["id"]


def test_bad_task_and_options_are_rejected(checkpoint):
  from d2f_jax import evaluate
  from d2f_jax.evals import make_task
  with pytest.raises(ValueError, match="unknown task 'mbpp'"):
    make_task("mbpp")
  with pytest.raises(SystemExit, match="stop_ids"):
    evaluate.main(["--model", checkpoint, "--task", "gsm8k", "--stop_ids", "1,x"])
  with pytest.raises(SystemExit, match="multiple of block_size"):
    evaluate.main(["--model", checkpoint, "--task", "gsm8k", "--block_size", "3", "--max_new_tokens", "16"])
  with pytest.raises(SystemExit, match="nope.jsonl"):
    evaluate.main(["--model", checkpoint, "--task", "gsm8k", "--data", "/nonexistent/nope.jsonl"])


def test_cli_isolation_flag_reaches_the_sandbox(monkeypatch):
  from d2f_jax import evaluate
  from d2f_jax.evals.sandbox import bwrap
  from d2f_jax.evals.sandbox import ProcessIsolationWarning
  with pytest.warns(ProcessIsolationWarning):
    task = evaluate.make_task(evaluate.build_parser().parse_args(["--model", "m", "--task", "humaneval",
                                                                  "--isolation", "process"]))
  assert task.options()["sandbox"]["isolation"] == "process"
  monkeypatch.setattr(bwrap, "probe", lambda python: "user namespaces are not permitted")
  with pytest.raises(SystemExit, match="not permitted.*isolation"):
    evaluate.make_task(evaluate.build_parser().parse_args(["--model", "m", "--task", "humaneval"]))


def test_generation_text_is_read_after_the_prompt(checkpoint):
  import d2f_jax
  from d2f_jax.evals.runner import decode_continuation

  model = d2f_jax.load_model(checkpoint)
  assert decode_continuation(model, [5, 6], [7, 8]).strip() == model.decode([7, 8]) == "w7 w8"

  class Joined:  # decodes each id alone differently from in context: the seam must come from the pair
    def decode(self, ids, **kwargs):
      return "".join("<" + str(i) + ">" if i == ids[0] else str(i) for i in ids)

  fake = type("M", (), {"tokenizer": Joined()})()
  assert decode_continuation(fake, [1, 2], [3, 4]) == "34"


# --- standard error, protocol labels ------------------------------------------------------------

def test_score_stderr_matches_lm_evals_and_a_hand_value():
  from d2f_jax.evals.stats import mean_stderr, score_stderr_percent
  outcomes = [1, 0, 1, 1, 0, 1, 1, 1]
  p, n = 6 / 8, 8
  assert mean_stderr(outcomes) == pytest.approx((p * (1 - p) * n / (n - 1) / n) ** 0.5, rel=1e-12)
  assert score_stderr_percent([bool(o) for o in outcomes]) == pytest.approx(100 * mean_stderr(outcomes))
  metrics = pytest.importorskip("lm_eval.api.metrics")
  assert mean_stderr(outcomes) == pytest.approx(metrics.mean_stderr(outcomes), rel=1e-12)
  assert mean_stderr([1]) is None and mean_stderr([0, 0]) == 0.0


def test_builtin_tasks_say_which_protocol_they_follow():
  assert "built-in" in gsm8k.Gsm8kTask().options()["protocol"]
  assert "not lm-eval's gsm8k" in gsm8k.Gsm8kTask().options()["protocol"]


def test_data_directory_is_the_env_var_else_the_user_data_dir(monkeypatch, tmp_path):
  from d2f_jax import datafiles
  monkeypatch.setenv("D2F_DATA_DIR", str(tmp_path))
  assert datafiles.default_path("gsm8k_test.jsonl") == str(tmp_path / "gsm8k_test.jsonl")
  with pytest.raises(FileNotFoundError, match="D2F_DATA_DIR"):  # a missing default file says where it looked
    datafiles.read_jsonl(datafiles.default_path("gsm8k_test.jsonl"))
  monkeypatch.delenv("D2F_DATA_DIR")
  monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
  assert datafiles.data_dir() == tmp_path / "xdg" / "d2f_jax"
  monkeypatch.delenv("XDG_DATA_HOME")
  assert str(datafiles.data_dir()).endswith(".local/share/d2f_jax")
