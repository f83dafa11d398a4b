"""`bench serve --versus ar`: the D2F engine in each throughput mode against the AR engine, same slots, same
held-out problems, the main job's models (its student and its AR baseline).

  python -m d2f_jax.bench serve --versus ar --config configs/tiny_e2e.py:long --workdir WORKDIR [--slots 8,32]

Modes: exact D2F (the authors' loop), then every query-limited or cached mode of the config's `mode_sweep` at the
decode block (or `--query_limits`). Every engine is warmed up first (compiles excluded); the engines then take turns,
`--repeats` times, each one completing every problem, and each engine's best time is reported (a shared
machine only ever slows a run down). Every answer is checked against `generate` on that problem alone (batch 1)
in the same mode: the engine's batch invariance, measured on the real models.

A CPU is compute-bound at any batch, so a D2F step there pays for every position it feeds: the ratio follows
positions per accepted token, not the memory-bound ratio an accelerator would show (bench cost projects that).
"""

from __future__ import annotations

import time

import jax
import numpy as np

from d2f_jax.bench.main_job import warm_engine


def modes_of(c, block_size: int) -> list[tuple[int, bool]]:
  """(query limit, cache_decided) of each throughput mode of the config's sweep that runs at the decode block
  (`mode_sweep` entries (block or None, q or None[, cache_decided])), in sweep order without repeats; a cached
  mode without a limit runs at q = the block size, as DecodeConfig runs it."""
  found = []
  for block, q, *cached in c.get("mode_sweep", ()):
    cached = bool(cached and cached[0])
    if block in (None, block_size) and (q is not None or cached):
      found.append((block_size if q is None else q, cached))
  return list(dict.fromkeys(found))


def _alone(model, prompts, config) -> list[list[int]]:
  """Each prompt's tokens decoded alone (batch 1), cut as the engine cuts them (through the first stop id)."""
  from d2f_jax.decode import generate
  return [generate(model, [prompt], config).to_lists()[0] for prompt in prompts]


def run(models: dict, prompts: dict, config, slots_list: list[int], limits: list[tuple[int, bool]], args
        ) -> list[dict]:
  """Rows per slot count: every D2F mode and AR, tokens/s and its ratio to AR's, tokens per forward, positions
  fed per accepted token, and whether every answer equals its batch-1 decode. `models` / `prompts`: 'd2f' (the
  student) and 'ar' (the AR baseline), prompts encoded by each one's tokenizer."""
  from d2f_jax.serve import RequestSettings
  modes = [("d2f", None, False)] + [("d2f", q, cached) for q, cached in limits] + [("ar", None, False)]
  configs = {mode: config.replace(method=mode[0], query_limit=mode[1], cache_decided=mode[2]) for mode in modes}
  settings = {"d2f": RequestSettings(tau_add=config.tau_add, tau_act=config.tau_act, tau_conf=config.tau_conf),
              "ar": RequestSettings()}
  want = {mode: _alone(models[mode[0]], prompts[mode[0]], configs[mode]) for mode in modes}
  longest = max(len(p) for ps in prompts.values() for p in ps)
  rows = []
  for slots in slots_list:
    engines = {mode: warm_engine(models[mode[0]], config, slots=slots, max_prompt_len=longest,
                                 steps_per_call=args.steps_per_call, max_insert=args.max_insert, method=mode[0],
                                 query_limit=mode[1], cache_decided=mode[2]) for mode in modes}
    best, done = {}, {}
    for _ in range(args.repeats):
      for mode, engine in engines.items():
        start = time.perf_counter()
        done[mode] = engine.complete(prompts[mode[0]], settings[mode[0]])
        best[mode] = min(best.get(mode, float("inf")), time.perf_counter() - start)
    ar = ("ar", None, False)
    ar_rate = sum(len(c.tokens) for c in done[ar]) / best[ar]
    for mode in modes:
      completions = done[mode]
      tokens = sum(len(c.tokens) for c in completions)
      forwards = sum(c.forwards for c in completions)
      positions = sum(c.stats.get("position_sum", 0) for c in completions) if mode[0] == "d2f" else forwards
      rate = tokens / best[mode]
      rows.append({"slots": slots, "engine": "ar" if mode == ar else
                   f"d2f {'exact' if mode[1] is None else f'q={mode[1]}'}" + " cached" * mode[2],
                   "problems": len(completions), "tokens": tokens, "tokens/s": round(rate, 1),
                   "vs ar": round(rate / ar_rate, 3), "tokens/forward": round(tokens / max(forwards, 1), 2),
                   "positions/token": round(positions / max(tokens, 1), 2),
                   "identical to batch 1": [c.tokens for c in completions] == want[mode]})
    del engines
    jax.clear_caches()  # the next slot count compiles its own programs; free these
  return rows


def main(args) -> None:
  """Load the main job's student and AR baseline from `args.workdir`, run, write the report."""
  from d2f_jax.bench.main_job import held_out_prompts, load_config, stage_model
  from d2f_jax.decode import DecodeConfig
  from d2f_jax.e2e.evaluation import decode_block_size
  from d2f_jax.reporting import write_report
  c = load_config(args.config)
  models = {name: stage_model(args.workdir, stage, args.config) for name, stage in (("d2f", "student"), ("ar", "ar"))}
  prompts = {name: held_out_prompts(model, c, args.limit) for name, model in models.items()}
  tau_add, tau_act, tau_conf = c.d2f_sweep[0]
  block = decode_block_size(c)
  config = DecodeConfig(method="d2f", block_size=block, max_new_tokens=c.max_new_tokens, tau_add=tau_add,
                        tau_act=tau_act, tau_conf=tau_conf, prompt_buckets=args.prompt_bucket)
  limits = ([(q, False) for q in args.query_limits] if args.query_limits is not None else modes_of(c, block))
  rows = run(models, prompts, config, args.slots, limits, args)
  write_report(args.json, "serve_versus_ar", rows, settings=dict(
      config=args.config, block_size=block, max_new_tokens=c.max_new_tokens, tau_add=tau_add, tau_act=tau_act,
      tau_conf=tau_conf, modes=[{"query_limit": q, "cache_decided": cached} for q, cached in limits], prompt_bucket=args.prompt_bucket, steps_per_call=args.steps_per_call,
      max_insert=args.max_insert, repeats=args.repeats, timing="best of the repeats, engines taking turns",
      mean_answer_tokens=float(np.mean([r["tokens"] / r["problems"] for r in rows]))))
  if not all(r["identical to batch 1"] for r in rows):
    raise SystemExit("an engine's answers differ from their batch-1 decodes (see 'identical to batch 1' above)")
