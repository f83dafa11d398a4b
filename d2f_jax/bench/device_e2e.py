"""End-to-end D2F vs AR tokens/s of the main job's models on whatever device runs this (bench device).

The miniature's measured ratio is a CPU's (compute-bound: a D2F forward over its window costs several AR
forwards); on an accelerator both forwards are launch- or memory-bound and the ratio should move towards the
tokens per forward. Same protocol as the main job's timing pass (e2e/evaluation.interleaved_timing: batch 1,
greedy, every prompt decoded by both rows in turn, compiles excluded), on the first `limit` held-out problems.
"""

from __future__ import annotations

import json
import os

HELD_OUT = 64  # problems timed: a few seconds per row on a GPU


def _config(workdir: str) -> dict:
  """The run's config (results.json), else configs/tiny_e2e.py's defaults."""
  path = os.path.join(workdir, "results.json")
  if os.path.exists(path):
    with open(path) as f:
      return json.load(f)["config"]
  from d2f_jax import config_files
  from d2f_jax.train.config import load_config_file
  return load_config_file(config_files.resolve("configs/tiny_e2e.py")).to_dict()


def measure(workdir: str, limit: int = HELD_OUT) -> list[dict] | None:
  """Rows (method, tokens/s, tokens/fwd, vs AR) or None when the main job's models are not in `workdir`."""
  student, ar = (os.path.join(workdir, stage, "hf") for stage in ("student", "ar"))
  if not (os.path.isdir(student) and os.path.isdir(ar)):
    return None
  import d2f_jax
  from d2f_jax.decode import DecodeConfig
  from d2f_jax.e2e.evaluation import decode_block_size, interleaved_timing
  from d2f_jax.evals.runner import encode_prompts
  from d2f_jax.tasks.arithmetic import ArithmeticTask
  c = _config(workdir)
  task = c["task"]
  items = ArithmeticTask(seed=c["seed"], train=task["train"], test=task["test"], min_steps=task["min_steps"],
                         max_steps=task["max_steps"], style=task.get("style", "terse")).load(limit)
  tau_add, tau_act, tau_conf = c["d2f_sweep"][0]
  common = dict(block_size=decode_block_size(c), max_new_tokens=c["max_new_tokens"], prompt_buckets=64)
  models = {"d2f": d2f_jax.load_model(student), "ar": d2f_jax.load_model(ar)}
  configs = {"d2f": DecodeConfig(method="d2f", tau_add=tau_add, tau_act=tau_act, tau_conf=tau_conf, **common),
             "ar": DecodeConfig(method="ar", **common)}
  calls = [(models[m], configs[m], encode_prompts(models[m], items)) for m in ("d2f", "ar")]
  timed = dict(zip(("d2f", "ar"), interleaved_timing(calls, bar_name="e2e timing")))
  rows = []
  for method, t in timed.items():
    rows.append({"method": method, "problems": len(items), "tokens/s": round(t["tokens"] / t["seconds"], 1),
                 "tokens/fwd": round(t["tokens"] / t["forwards"], 2),
                 "ms/fwd": round(1000 * t["seconds"] / t["forwards"], 3)})
  ar_speed = rows[1]["tokens/s"]
  for row in rows:
    row["vs AR"] = f"{row['tokens/s'] / ar_speed:.2f}x"
  return rows
