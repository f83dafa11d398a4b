"""Functions the local lm-eval task configs call (`!function d2f_tasks.NAME`): the local test files as
datasets, few-shot exemplars, the built-in harness's GSM8K scoring, and HumanEval judged in the project's
sandbox (evals/sandbox/)."""

from __future__ import annotations

import functools
import os

from d2f_jax.datafiles import default_path, read_jsonl
from d2f_jax.evals import gsm8k, humaneval


def _local_test_split(filename: str, required: tuple[str, ...]):
  import datasets
  rows = read_jsonl(default_path(filename), required)
  return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def gsm8k_test(**_metadata):
  """The GSM8K test file from the data directory (lm-eval passes the task's metadata; unused)."""
  return _local_test_split(gsm8k.DEFAULT_FILE, ("question", "answer"))


def humaneval_test(**_metadata):
  """The HumanEval file from the data directory."""
  return _local_test_split(humaneval.DEFAULT_FILE, ("task_id", "prompt", "test", "entry_point"))


def builtin_exemplars() -> list[dict]:
  """The built-in harness's 8 GSM8K-style exemplars (no train split is stored locally)."""
  return [{"question": q, "answer": a} for q, a in gsm8k.BUILTIN_EXEMPLARS]


def gsm8k_builtin_results(doc: dict, results: list[str]) -> dict:
  """Exact match the built-in harness's way: cut at its stop strings, its answer extraction."""
  answer = gsm8k.extract_answer(gsm8k.truncate(results[0]))
  return {"exact_match": float(answer is not None and answer == gsm8k.gold_answer(doc["answer"]))}


@functools.lru_cache(maxsize=None)
def _sandbox():
  from d2f_jax.evals.sandbox import Sandbox
  return Sandbox(isolation=os.environ.get("D2F_SANDBOX_ISOLATION", "bubblewrap"),
                 timeout_s=float(os.environ.get("D2F_SANDBOX_TIMEOUT", "10")))


def humaneval_results(doc: dict, results: list[str]) -> dict:
  """pass@1 of one generation: human-eval truncation, then the sandbox's judged verdict."""
  completion = humaneval.truncate_completion(results[0], doc["entry_point"])
  return {"pass@1": float(_sandbox().run_test(humaneval.build_test(doc, completion)).passed)}
