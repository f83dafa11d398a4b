"""Serving benchmark on the miniature's D2F student: the continuous-batching engine against `generate` in static
batches of the same size, side by side in one run, outputs checked identical; then (`--load`) an open-loop load
test against the real server (bench/serve_load.py).

  python -m d2f_jax.main                      # trains the student into workdir/tiny_e2e (once)
  python -m d2f_jax.bench serve [--slots 8,32] [--limit 256] [--load]

A static batch runs until its slowest row is done, so the rows that finish early idle their share of every
forward; the engine refills a finished slot with the next problem. Greedy, the paper's thresholds, the main
job's block size and answer length; compile time excluded from both (each side is warmed up first).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time

import jax

from d2f_jax.reporting import write_report
from d2f_jax.usage import ArgumentParser, UsageError

DEFAULT_WORKDIR = os.path.join("workdir", "tiny_e2e")


def load_student(workdir: str):
  """The main job's D2F student and its config; a clear exit when the main job has not been run."""
  import d2f_jax
  from d2f_jax import config_files
  path = os.path.join(workdir, "student", "hf")
  if not os.path.isfile(os.path.join(path, "config.json")):
    raise UsageError(f"no trained D2F student in {path}: run `python -m d2f_jax.main --workdir {workdir}` "
                     "first (about 12 minutes on 2 CPU cores), or pass --workdir")
  spec = importlib.util.spec_from_file_location("tiny_e2e", config_files.resolve("configs/tiny_e2e.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return d2f_jax.load_model(path), module.get_config()


def held_out_prompts(model, c, limit: int) -> list[list[int]]:
  from d2f_jax.evals.runner import encode_prompts
  from d2f_jax.tasks.arithmetic import ArithmeticTask
  task = ArithmeticTask(seed=c.seed, train=c.task.train, test=c.task.test, min_steps=c.task.min_steps,
                        max_steps=c.task.max_steps)
  return encode_prompts(model, task.load(limit))


def static_batches(model, prompts, config, slots: int) -> tuple[list[list[int]], float, int]:
  """(tokens per prompt, seconds, device calls) of `generate` over consecutive batches of `slots` prompts."""
  from d2f_jax.decode import generate
  batches = [prompts[i:i + slots] for i in range(0, len(prompts), slots)]
  for batch in {len(b): b for b in batches}.values():  # compile every batch shape first
    jax.block_until_ready(generate(model, batch, config).tokens)
  start = time.perf_counter()
  results = [generate(model, batch, config) for batch in batches]
  tokens = [row for r in results for row in r.to_lists()]
  return tokens, time.perf_counter() - start, len(batches)


def engine_run(model, prompts, config, slots: int, steps_per_call: int) -> tuple[list[list[int]], float, int]:
  """(tokens per prompt, seconds, advance calls) of the engine with `slots` slots over every prompt."""
  from d2f_jax.serve import Engine, EngineConfig, RequestSettings
  engine = Engine(model, EngineConfig(slots=slots, block_size=config.block_size,
                                      max_new_tokens=config.max_new_tokens, max_prompt_len=max(map(len, prompts)),
                                      prompt_bucket=64, steps_per_call=steps_per_call))
  settings = RequestSettings(tau_add=config.tau_add, tau_act=config.tau_act, tau_conf=config.tau_conf)
  engine.complete(prompts[:slots + 1], settings)  # warm-up: every program compiled, a slot refilled
  calls = engine.advance_calls
  start = time.perf_counter()
  done = engine.complete(prompts, settings)
  return [c.tokens for c in done], time.perf_counter() - start, engine.advance_calls - calls


def _sizes(text: str) -> list[int]:
  try:
    sizes = [int(s) for s in text.split(",") if s.strip()]
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected comma-separated slot counts, got {text!r}") from None
  if not sizes or min(sizes) < 1:
    raise argparse.ArgumentTypeError(f"expected positive slot counts, got {text!r}")
  return sizes


def _rates(text: str) -> list[float]:
  try:
    rates = [float(s) for s in text.split(",") if s.strip()]
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected comma-separated request rates, got {text!r}") from None
  if not rates or min(rates) <= 0:
    raise argparse.ArgumentTypeError(f"expected positive request rates, got {text!r}")
  return rates


def parse_args(argv):
  p = ArgumentParser("python -m d2f_jax.bench serve", __doc__)
  p.add_argument("--workdir", default=DEFAULT_WORKDIR, help="the main job's workdir (its student/hf is served)")
  p.add_argument("--slots", type=_sizes, default="8,32", help="engine slots = static batch sizes, comma-separated")
  p.add_argument("--limit", type=int, default=256, help="held-out problems")
  p.add_argument("--steps_per_call", type=int, default=4, help="engine D2F steps per device call")
  p.add_argument("--load", action="store_true", help="also run the open-loop load test against the real server")
  p.add_argument("--rates", type=_rates, default="4,16,64", help="--load: offered requests per second")
  p.add_argument("--requests", type=int, default=128, help="--load: requests per rate")
  p.add_argument("--json", default="results/bench_serve.json", help="where the report is written")
  return p.parse_args(argv)


def main(argv: list[str]) -> None:
  args = parse_args(argv)
  from d2f_jax.decode import DecodeConfig
  model, c = load_student(args.workdir)
  prompts = held_out_prompts(model, c, args.limit)
  tau_add, tau_act, tau_conf = c.d2f_sweep[0]
  config = DecodeConfig(method="d2f", block_size=c.block_size, max_new_tokens=c.max_new_tokens,
                        tau_add=tau_add, tau_act=tau_act, tau_conf=tau_conf, prompt_buckets=64)
  rows = []
  for slots in args.slots:
    want, static_s, batches = static_batches(model, prompts, config, slots)
    got, engine_s, calls = engine_run(model, prompts, config, slots, args.steps_per_call)
    generated = sum(map(len, want))
    rows.append({"slots": slots, "problems": len(prompts), "tokens": generated,
                 "static tokens/s": round(generated / static_s, 1), "engine tokens/s": round(generated / engine_s, 1),
                 "engine / static": round(static_s / engine_s, 3), "identical": got == want,
                 "static batches": batches, "engine advance calls": calls})
  extra = {"settings": dict(block_size=c.block_size, max_new_tokens=c.max_new_tokens, tau_add=tau_add,
                            tau_act=tau_act, tau_conf=tau_conf, steps_per_call=args.steps_per_call)}
  if args.load:
    from d2f_jax.bench import serve_load
    extra["load"] = serve_load.run(os.path.join(args.workdir, "student", "hf"), prompts, config,
                                   slots=max(args.slots), rates=args.rates, count=args.requests)
  write_report(args.json, "serve", rows, **extra)
  if args.load:
    from d2f_jax.reporting import format_table
    print(format_table(extra["load"]))
  if not all(r["identical"] for r in rows):
    raise SystemExit("the engine's outputs differ from generate's (see 'identical' above)")


if __name__ == "__main__":
  import sys
  main(sys.argv[1:])
