"""Run a benchmark end to end: prompts -> batched `generate` -> score, with the paper's speed measures.

Speed is measured the way the paper reports it: tokens per second = generated tokens (up to and
including the stop token, as `d2f_jax.generate` counts them) over the wall time of the `generate` calls,
tokens per forward = generated tokens over model forwards, and latency per sample. The paper's setting is
batch 1; larger batches are allowed and say so in the results. Compilation is kept out of the timing by
warm-up calls (one per distinct prompt shape by default); a timed call that still compiled is counted.

Several processes (jax.distributed) split the batches between them (evals/processes.py); process 0 writes
one results.json / samples.jsonl equal in content and order to a single-process run's (timings aside).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time
from typing import Callable

import jax
import numpy as np
from tqdm import tqdm

from d2f_jax.decode import DecodeConfig, generate, trace_count
from d2f_jax.decode.methods import check_method_fits, model_attention
from d2f_jax.reporting import write_json, write_jsonl
from d2f_jax.evals.engine_pass import engine_fits, run_engine
from d2f_jax.evals.gsm8k import Gsm8kTask
from d2f_jax.evals.humaneval import HumanEvalTask
from d2f_jax.evals.processes import Processes, assign_batches, jax_processes, merge_shares
from d2f_jax.evals.stats import score_stderr_percent
from d2f_jax.tasks.arithmetic import ArithmeticTask

TASKS = {"gsm8k": Gsm8kTask, "humaneval": HumanEvalTask, "arithmetic": ArithmeticTask}
WARMUPS = ("shapes", "first", "none")


def make_task(name: str, **options):
  """A task by name with its options (e.g. n_shot for gsm8k, sandbox for humaneval)."""
  if name not in TASKS:
    raise ValueError(f"unknown task {name!r}; choose one of {', '.join(TASKS)}")
  return TASKS[name](**options)


def _stderr(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def encode_prompts(model, items: list[dict], *, chat: bool = False, add_bos: bool = False) -> list[list[int]]:
  bos = getattr(model.config, "bos_token_id", None)
  if add_bos and bos is None:
    raise ValueError("add_bos=True but the model config has no bos_token_id")
  prompts = []
  for item in items:
    ids = list(model.encode(item["prompt"], chat=chat))
    if add_bos and (not ids or ids[0] != bos):
      ids = [bos] + ids
    if not ids:
      raise ValueError(f"prompt of {item['id']} encodes to no tokens")
    prompts.append(ids)
  return prompts


def decode_continuation(model, prompt: list[int], generated: list[int]) -> str:
  """Text of `generated` as it reads after `prompt`.

  Decoding the pair and cutting off the prompt's text keeps what a lone decode can lose at the seam
  (a SentencePiece leading space, which is a code indent for HumanEval); falls back to a lone decode.
  Tokenization-space clean-up stays off: it rewrites " ." and " '" inside code.
  """
  tokenizer = getattr(model, "tokenizer", None)
  if tokenizer is None:
    return model.decode(generated)
  text = lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True,  # noqa: E731
                                      clean_up_tokenization_spaces=False)
  head, whole = text(prompt), text(list(prompt) + list(generated))
  return whole[len(head):] if whole.startswith(head) else text(generated)


def _warmup_batches(batches: list[list[int]], prompts, config: DecodeConfig, mode: str,
                    mine: list[int] | None = None) -> list[int]:
  """Indices of the batches (among `mine`, default all) to run untimed first: one per distinct
  (rows, padded length) shape."""
  mine = list(range(len(batches))) if mine is None else mine
  if mode == "none" or not mine:
    return []
  if mode == "first":
    return [mine[0]]
  first_of_shape: dict[tuple[int, int], int] = {}
  for b in mine:
    rows = batches[b]
    shape = (len(rows), config.bucket(max(len(prompts[i]) for i in rows)))
    first_of_shape.setdefault(shape, b)
  return sorted(first_of_shape.values())


def run_benchmark(model, task, config: DecodeConfig, *, batch_size: int = 1, limit: int | None = None,
                  chat: bool = False, add_bos: bool = False, warmup: str = "shapes", seed: int = 0,
                  out_dir: str | None = None, log: Callable[[str], None] | None = _stderr,
                  processes: Processes | None = None) -> dict:
  """Generate for every item of `task`, score, time, and (with `out_dir`) write results.json + samples.jsonl.

  model: a d2f_jax.Model (anything with .config, .graphdef, .state, .encode, .decode; a `shard`ed one decodes
  on its mesh). warmup: 'shapes' (one untimed call per distinct prompt shape, so no compile is timed),
  'first' (the first batch only) or 'none'. processes: this process's share and the gather (default: the
  JAX job's processes); every process returns the merged results, process 0 writes the files.
  Returns the results dict that results.json holds.
  """
  if not isinstance(batch_size, int) or batch_size < 1:
    raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
  if warmup not in WARMUPS:
    raise ValueError(f"warmup must be one of {WARMUPS}, got {warmup!r}")
  check_method_fits(model.config, config, model_attention(model))  # a mismatched method decodes garbage
  procs = jax_processes() if processes is None else processes
  quiet, log = log is None, log or (lambda message: None)
  if procs.count > 1:
    log = (lambda inner: lambda message: inner(f"[process {procs.index}/{procs.count}] {message}"))(log)
  items = task.load(limit)
  prompts = encode_prompts(model, items, chat=chat, add_bos=add_bos)
  batches = [list(range(i, min(i + batch_size, len(items)))) for i in range(0, len(items), batch_size)]
  mine = assign_batches(len(batches), procs.index, procs.count)
  if engine_fits(config, batch_size):
    return _finish_run(model, task, config, items, prompts, batches, mine, procs, log, out_dir,
                       *_through_engine(model, task, config, prompts, batches, mine, warmup, log, quiet),
                       batch_size=batch_size, limit=limit, chat=chat, add_bos=add_bos, seed=seed, warmup=warmup,
                       engine=True)
  key = jax.random.key(seed)
  call = lambda b: generate(model, [prompts[i] for i in batches[b]], config,  # noqa: E731
                            key=jax.random.fold_in(key, b))

  warm = _warmup_batches(batches, prompts, config, warmup, mine)
  start = time.perf_counter()
  for b in warm:
    jax.block_until_ready(call(b))
  warmup_seconds = time.perf_counter() - start
  if warm:
    log(f"[{task.name}] warm-up: {len(warm)} untimed batch(es) in {warmup_seconds:.1f}s (compilation)")

  ids: dict[int, list[int]] = {}
  forwards, latency, batch_of = {}, {}, {}
  batch_seconds, compiled_batches = [], 0
  report_every = max(1, len(mine) // 10)
  bar = _progress(task, sum(len(batches[b]) for b in mine), quiet)
  for n, b in enumerate(mine):
    rows = batches[b]
    traces = trace_count("loop")
    start = time.perf_counter()
    result = jax.block_until_ready(call(b))
    seconds = time.perf_counter() - start
    compiled_batches += trace_count("loop") > traces
    batch_seconds.append([b, seconds])
    for row, tokens, f in zip(rows, result.to_lists(), np.asarray(result.forwards)):
      ids[row], forwards[row], latency[row], batch_of[row] = tokens, int(f), seconds, b
    bar.update(len(rows))
    if (n + 1) % report_every == 0 or n + 1 == len(mine):
      tokens_so_far = sum(len(t) for t in ids.values())
      log(f"[{task.name}] {len(ids)}/{len(items)} samples, "
          f"{tokens_so_far / sum(s for _, s in batch_seconds):.1f} tokens/s")
  bar.close()
  timing = dict(warmup_batches=len(warm), warmup_seconds=warmup_seconds, compiled_batches=compiled_batches)
  return _finish_run(model, task, config, items, prompts, batches, mine, procs, log, out_dir, ids, forwards, latency,
                     batch_of, batch_seconds, timing, batch_size=batch_size, limit=limit, chat=chat, add_bos=add_bos,
                     seed=seed, warmup=warmup, engine=False)


def _progress(task, total: int, quiet: bool):
  """A progress bar on stderr over this process's problems (off when the caller silenced logging)."""
  return tqdm(total=total, desc=task.name, unit="problem", file=sys.stderr, disable=quiet, leave=False)


def _through_engine(model, task, config, prompts, batches, mine, warmup, log, quiet):
  """This process's problems through the continuous-batching engine (batch_size slots); its wall time is
  spread over the batches by their rows so the merged seconds add up to it."""
  rows = [i for b in mine for i in batches[b]]
  if not rows:  # a process with no share
    return {}, {}, {}, {}, [], dict(warmup_batches=0, warmup_seconds=0.0, compiled_batches=0)
  bar = _progress(task, len(rows), quiet)
  run = run_engine(model, [prompts[i] for i in rows], config, len(batches[0]), warmup=warmup, progress=bar.update)
  bar.close()
  if run["warmup_requests"]:
    log(f"[{task.name}] warm-up: {run['warmup_requests']} untimed request(s) in {run['warmup_seconds']:.1f}s "
        "(compilation)")
  ids, forwards, latency = (dict(zip(rows, run[k])) for k in ("tokens", "forwards", "latency"))
  batch_of = {i: b for b in mine for i in batches[b]}
  batch_seconds = [[b, run["seconds"] * len(batches[b]) / len(rows)] for b in mine]
  timing = dict(warmup_batches=run["warmup_requests"], warmup_seconds=run["warmup_seconds"], compiled_batches=0)
  return ids, forwards, latency, batch_of, batch_seconds, timing


def _finish_run(model, task, config, items, prompts, batches, mine, procs, log, out_dir, ids, forwards, latency,
                batch_of, batch_seconds, timing, *, batch_size, limit, chat, add_bos, seed, warmup, engine) -> dict:
  """Score this process's generations, merge every process's share, write and return the results."""
  rows_mine = sorted(ids)
  generations = [decode_continuation(model, prompts[i], ids[i]) for i in rows_mine]
  records = task.score([items[i] for i in rows_mine], generations)
  share = []
  for i, text, record in zip(rows_mine, generations, records):
    kept_tokens = len(model.encode(record["kept"])) if record["kept"].strip() else 0
    share.append([i, {"id": items[i]["id"], "prompt_tokens": len(prompts[i]), "generation": text, **record,
                      "tokens": len(ids[i]), "kept_tokens": kept_tokens, "forwards": forwards[i],
                      "batch": batch_of[i], "latency_s": round(float(latency[i]), 6)}])
  merged = merge_shares(procs.gather({"samples": share, "batch_seconds": batch_seconds, **timing}),
                        len(items), len(batches))
  samples = merged["samples"]

  results = summarize(model, task, config, samples, merged["batch_seconds"], batch_size=batch_size, limit=limit,
                      chat=chat, add_bos=add_bos, seed=seed,
                      warmup=dict(mode=warmup, batches=merged["warmup_batches"],
                                  seconds=round(merged["warmup_seconds"], 3),
                                  compiled_batches_in_timing=merged["compiled_batches"]))
  results["speed"]["processes"] = procs.count
  results["speed"]["engine"] = engine  # batch > 1 through the continuous-batching engine (slots = batch_size)
  if out_dir is not None and procs.is_main:
    os.makedirs(out_dir, exist_ok=True)
    write_json(os.path.join(out_dir, "results.json"), results)
    write_jsonl(os.path.join(out_dir, "samples.jsonl"), samples)
    results["files"] = {"results": os.path.join(out_dir, "results.json"),
                        "samples": os.path.join(out_dir, "samples.jsonl")}
  speed = results["speed"]
  log(f"[{task.name}] {task.metric} {results['score']:.2f} ({results['correct']}/{results['total']}), "
      f"{speed['tokens_per_s'] or 0:.1f} tokens/s, {speed['tokens_per_forward'] or 0:.2f} tokens/forward, "
      f"{speed['latency_s_mean']:.2f}s latency per sample (batch {batch_size})")
  return results


def _mesh_shape(model) -> dict | None:
  placement = getattr(model, "placement", None)
  return None if placement is None else {k: int(v) for k, v in placement.mesh.shape.items()}


def summarize(model, task, config: DecodeConfig, samples: list[dict], batch_seconds: list[float], *,
              warmup: dict, **settings) -> dict:
  """The results.json payload: score, speed, and every setting needed to reproduce the run."""
  from d2f_jax.reporting import environment  # jax device facts, shared with the benchmarks

  total = len(samples)
  correct = sum(bool(s["correct"]) for s in samples)
  tokens = sum(s["tokens"] for s in samples)
  kept = sum(s["kept_tokens"] for s in samples)
  forwards = sum(s["forwards"] for s in samples)
  seconds = float(sum(batch_seconds))
  per = lambda n, d: n / d if d > 0 else None  # noqa: E731  (None, not NaN: results.json stays strict JSON)
  latencies = [s["latency_s"] for s in samples]
  speed = {  # with several processes: seconds summed over them (per-process throughput), see "processes"
      "tokens": tokens, "kept_tokens": kept, "forwards": forwards, "generate_seconds": round(seconds, 6),
      "tokens_per_s": per(tokens, seconds), "kept_tokens_per_s": per(kept, seconds),
      "tokens_per_forward": per(tokens, forwards), "seconds_per_sample": per(seconds, total),
      "latency_s_mean": statistics.fmean(latencies), "latency_s_median": statistics.median(latencies),
      "warmup": warmup,
  }
  return {
      "task": task.name, "metric": task.metric, "score": 100.0 * correct / total,
      "score_stderr": score_stderr_percent(s["correct"] for s in samples), "correct": correct,
      "total": total, "model": getattr(model, "source", ""), "family": model.config.family,
      "model_dtype": model.config.dtype, "lora": getattr(model, "lora", None) is not None,
      "attention": model.config.attention_impl, "mesh": _mesh_shape(model),
      "decode": dataclasses.asdict(config), "settings": settings, "task_options": task.options(),
      "speed": speed, "environment": environment(),
      "notes": ("score in percent. tokens = generated ids up to and including the stop token over the "
                "wall time of the timed generate calls (warm-up calls excluded); kept_tokens = the part "
                "scored after cutting at the task's stop strings, re-encoded (approximate). "
                "tokens_per_forward = tokens / model forwards summed over samples. latency = wall time "
                "of the batch a sample was in; the paper reports batch 1."),
  }
