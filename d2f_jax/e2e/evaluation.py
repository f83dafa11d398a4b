"""Evaluation of the miniature: every decoding row on the held-out problems, with speed and D2F diagnostics.

Accuracy comes from the shared harness (`d2f_jax.evals.runner.run_benchmark`, batch 1, compile excluded).
Speed comes from one interleaved timing pass after it: every prompt is decoded by every row in turn (the
order rotating from prompt to prompt), so a slower minute of a shared machine slows every row alike and the
ratios between rows stay put; timed one row after another, as the harness does, the same run moved D2F's
ratio to the threshold decoder between 0.96x and 1.07x. The pass must reproduce the harness's tokens and
forwards exactly (greedy decoding), which it checks. The pipelining diagnostics (mean blocks in flight, window
width and positions computed per forward) come from the same timing pass, at batch 1, and again from a greedy
pass at batch 32 (`window_at_batch`): rows of a batch decode exactly as alone (tests/test_decode), but a batch's
forward runs the compiled width that holds its widest live row, so the window a row pays grows with the batch
(what bench cost projects at batch reads that growth from these two).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time

import jax
import numpy as np
from tqdm import tqdm

from d2f_jax.decode import DecodeConfig, generate, trace_count
from d2f_jax.evals.runner import encode_prompts, run_benchmark

# role -> the model column of the results table
MODEL_NAMES = {"teacher": "teacher: Dream layout, AR -> MDM", "student": "D2F student (Dream layout)",
               "ar": "AR: Dream layout, causal", "llada_teacher": "teacher: LLaDA layout, MDM from scratch"}


def decode_block_size(c) -> int:
  """The block every decoder runs at: `decode_block_size`, or the training `block_size` when it is None or
  absent (the authors distill at block 16 and decode at 32). `c`: a ConfigDict, a plain dict (results.json's
  config) or any object with those attributes."""
  field = c.get if hasattr(c, "get") else (lambda key: getattr(c, key, None))
  return field("decode_block_size") or field("block_size")


def decode_rows(c, models: dict) -> list[tuple[str, str, str, DecodeConfig]]:
  """(method, model role, settings text, DecodeConfig) for every row of the comparison."""
  common = dict(block_size=decode_block_size(c), max_new_tokens=c.max_new_tokens, prompt_buckets=64)
  n = c.max_new_tokens
  cap = c.max_blocks_in_flight or None
  rows = []
  for role in ("teacher", "llada_teacher"):
    if role not in models:
      continue
    rows += [("vanilla", role, f"LLaDA semi-AR, {n} steps", DecodeConfig(method="vanilla", steps=n, **common)),
             ("dream_vanilla", role, f"Dream, {n} steps", DecodeConfig(method="dream_vanilla", steps=n, **common)),
             ("threshold", role, f"tau_conf={c.threshold_tau_conf}",
              DecodeConfig(method="threshold", tau_conf=c.threshold_tau_conf, **common))]
  for tau_add, tau_act, tau_conf in c.d2f_sweep:
    rows.append(("d2f", "student", f"add={tau_add} act={tau_act} conf={tau_conf}",
                 DecodeConfig(method="d2f", tau_add=tau_add, tau_act=tau_act, tau_conf=tau_conf,
                              max_blocks_in_flight=cap, **common)))
  tau_add, tau_act, tau_conf = c.d2f_sweep[0]  # the throughput modes run at the paper's thresholds
  for block, query_limit, *cached in c.get("mode_sweep", ()):  # (block, q) or (block, q, cache_decided)
    cached = bool(cached and cached[0])
    mode = {"block_size": block or common["block_size"], "query_limit": query_limit, "cache_decided": cached}
    label = " ".join([f"{key}={value}" for key, value in (("block", block), ("q", query_limit)) if value]
                     + ["cached"] * cached)
    rows.append(("d2f", "student", f"add={tau_add} act={tau_act} conf={tau_conf} {label}",
                 DecodeConfig(method="d2f", tau_add=tau_add, tau_act=tau_act, tau_conf=tau_conf,
                              max_blocks_in_flight=cap, **{**common, **mode})))
  rows.append(("ar", "ar", "KV cache", DecodeConfig(method="ar", **common)))
  return rows


def standard_error(percent: float, total: int) -> float:
  """Binomial standard error of an accuracy in percent over `total` problems."""
  p = percent / 100.0
  return 100.0 * math.sqrt(p * (1.0 - p) / total) if total else float("nan")


WINDOW_BATCH = 32  # the batch of the second pipelining measurement (window_at_batch)
# (sum name, DecodeResult field): what the window means are formed from
WINDOW_SUMS = (("forwards", "forwards"), ("in_flight", "in_flight_sum"), ("window", "window_sum"),
               ("positions", "position_sum"))


def window_sums(result) -> dict[str, int]:
  """A DecodeResult's forwards, blocks in flight, window widths and positions computed, summed over its rows."""
  return {name: int(np.asarray(getattr(result, field)).sum()) for name, field in WINDOW_SUMS}


def window_means(sums: dict) -> dict:
  """Mean blocks in flight, window width (blocks) and positions computed per forward from `window_sums` (all
  None without forwards)."""
  forwards = sums.get("forwards")
  if not forwards:
    return {"mean_in_flight": None, "mean_window_blocks": None, "mean_window_positions": None}
  return {"mean_in_flight": sums["in_flight"] / forwards, "mean_window_blocks": sums["window"] / forwards,
          "mean_window_positions": sums["positions"] / forwards}


def pipelining_stats(model, prompts: list[list[int]], config: DecodeConfig, batch: int = WINDOW_BATCH) -> dict:
  """window_means over all forwards of all prompts decoded `batch` at a time (d2f, threshold; {} otherwise):
  a forward's width and positions are those compiled for the batch's widest live row."""
  if config.method not in ("d2f", "threshold"):
    return {}
  sums = dict.fromkeys((name for name, _ in WINDOW_SUMS), 0)
  for i in range(0, len(prompts), batch):
    for name, value in window_sums(generate(model, prompts[i:i + batch], config)).items():
      sums[name] += value
  return window_means(sums)


class _Bar:
  """A tqdm bar named after the row, advanced by the harness's 'k/N samples' progress lines."""

  def __init__(self, name: str, total: int):
    self.bar = tqdm(total=total, desc=name, dynamic_ncols=True, leave=True)

  def __call__(self, message: str) -> None:
    match = re.search(r"\] (\d+)/(\d+) samples", message)
    if match:
      self.bar.update(int(match.group(1)) - self.bar.n)
    elif "warm-up" in message:
      self.bar.set_postfix_str("compiled")

  def close(self) -> None:
    self.bar.close()


def evaluate(c, models: dict, task, out_dir: str, progress=print) -> list[dict]:
  rows, calls = [], []
  items = task.load()
  for i, (method, role, settings, dc) in enumerate(decode_rows(c, models)):
    model = models[role]
    bar = _Bar(f"eval {i + 1}: {method} on {role}", len(items))
    try:
      result = run_benchmark(model, task, dc, batch_size=c.eval_batch_size,
                             out_dir=os.path.join(out_dir, "eval", f"{i:02d}_{method}_{role}"), log=bar)
    finally:
      bar.close()
    speed = result["speed"]
    prompts = encode_prompts(model, items)
    calls.append((model, dc, prompts))
    row = {"method": method, "model": MODEL_NAMES[role], "role": role, "settings": settings,
           "accuracy": result["score"], "stderr": standard_error(result["score"], result["total"]),
           "total": result["total"], "tokens": speed["tokens"], "forwards": speed["forwards"],
           "tokens_per_forward": speed["tokens_per_forward"], "harness_tokens_per_s": speed["tokens_per_s"],
           "latency_ms": 1000 * speed["latency_s_mean"],
           "window_at_batch": {str(WINDOW_BATCH): pipelining_stats(model, prompts, dc)},
           "prompt_tokens_mean": float(np.mean([len(p) for p in prompts])),
           "decode": dataclasses.asdict(dc)}
    progress(f"eval {i + 1}: {method} on {role}: exact match {row['accuracy']:.1f} +- {row['stderr']:.1f} %, "
             f"{row['tokens_per_forward']:.2f} tokens/forward")
    rows.append(row)
  progress(f"timing: {len(items)} prompts, each decoded by the {len(calls)} rows in turn")
  for row, timed in zip(rows, interleaved_timing(calls)):
    if (timed["tokens"], timed["forwards"]) != (row["tokens"], row["forwards"]):
      raise RuntimeError(f"the timing pass of {row['method']} on {row['role']} decoded {timed['tokens']} tokens in "
                         f"{timed['forwards']} forwards, the accuracy pass {row['tokens']} in {row['forwards']}: "
                         f"greedy decoding should repeat exactly")
    row["timed_seconds"] = timed["seconds"]
    row.update(window_means(timed if row["method"] in ("d2f", "threshold") else {}))
    row["tokens_per_s"] = timed["tokens"] / timed["seconds"] if timed["seconds"] else None
    row["ms_per_forward"] = 1000.0 * timed["seconds"] / timed["forwards"] if timed["forwards"] else None
  return add_ratios(rows)


def interleaved_timing(calls: list[tuple], bar_name: str = "timing") -> list[dict]:
  """Seconds, tokens and forwards of each (model, DecodeConfig, prompts) call over its prompts at batch 1,
  prompt by prompt with every call in turn (starting one call later each prompt), and the sums of blocks in
  flight, window widths and positions computed (d2f, threshold; 0 otherwise). A call that compiled (a prompt
  shape not seen before) is timed again, so no compile is timed."""
  totals = [{"seconds": 0.0, "tokens": 0, **dict.fromkeys((name for name, _ in WINDOW_SUMS), 0)} for _ in calls]
  count = len(calls[0][2]) if calls else 0
  for p in tqdm(range(count), desc=bar_name, dynamic_ncols=True):
    for j in range(len(calls)):
      index = (p + j) % len(calls)
      model, config, prompts = calls[index]
      traces = -1
      while traces != trace_count("loop"):
        traces = trace_count("loop")
        start = time.perf_counter()
        result = jax.block_until_ready(generate(model, [prompts[p]], config))
        seconds = time.perf_counter() - start
      totals[index]["seconds"] += seconds
      totals[index]["tokens"] += len(result.to_lists()[0])
      for name, value in window_sums(result).items():  # one row: its own
        totals[index][name] += value
  return totals


def add_ratios(rows: list[dict]) -> list[dict]:
  """tokens/s of every row relative to AR decoding and to the teacher's threshold decoder, same run."""
  base = {"ar": next((r for r in rows if r["method"] == "ar"), None),
          "threshold": next((r for r in rows if r["method"] == "threshold"), None)}
  for row in rows:
    for name, ref in base.items():
      row[f"speedup_vs_{name}"] = (row["tokens_per_s"] / ref["tokens_per_s"]
                                   if ref and ref["tokens_per_s"] and row["tokens_per_s"] else None)
  return rows


def first_trace(c, student, item: dict) -> tuple[np.ndarray, int, str]:
  """(acceptance trace, block, title) of the student decoding one held-out problem at the paper's thresholds:
  when each token landed, for report.plot_trace."""
  tau_add, tau_act, tau_conf = c.d2f_sweep[0]
  block = decode_block_size(c)
  dc = DecodeConfig(method="d2f", block_size=block, max_new_tokens=c.max_new_tokens, tau_add=tau_add,
                    tau_act=tau_act, tau_conf=tau_conf, max_blocks_in_flight=c.max_blocks_in_flight or None)
  result = generate(student, encode_prompts(student, [item]), dc, key=jax.random.key(c.seed))
  title = (f"D2F student, one held-out problem: {int(result.forwards[0])} forwards for "
           f"{int(result.lengths[0])} tokens (paper thresholds)")
  return jax.device_get(result.trace)[0], block, title
