"""Benchmark evaluation (GSM8K, HumanEval) of real checkpoints: prompts, scoring, sandbox, timed runner.

    from d2f_jax.evals import make_task, run_benchmark
    results = run_benchmark(model, make_task("gsm8k", n_shot=4), DecodeConfig(), out_dir="results/evals/x")

Command line: `python -m d2f_jax.evaluate --model PATH --task gsm8k|humaneval ...`.
"""

import importlib

# Lazy, so scoring or the sandbox can be used (e.g. by an offline re-scorer) without importing JAX.
_EXPORTS = {
    "Gsm8kTask": "gsm8k", "extract_answer": "gsm8k", "normalize_number": "gsm8k",
    "HumanEvalTask": "humaneval", "build_program": "humaneval", "truncate_completion": "humaneval",
    "TASKS": "runner", "make_task": "runner", "run_benchmark": "runner",
    "ExecResult": "sandbox", "Sandbox": "sandbox",
    "Processes": "processes", "assign_batches": "processes", "merge_shares": "processes",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
  if name in _EXPORTS:
    return getattr(importlib.import_module(f"d2f_jax.evals.{_EXPORTS[name]}"), name)
  raise AttributeError(f"module 'd2f_jax.evals' has no attribute {name!r}")
