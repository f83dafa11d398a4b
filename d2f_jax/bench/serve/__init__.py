"""Serving benchmark on the miniature's D2F student: the continuous-batching engine against `generate` in static
batches of the same size, side by side in one run, outputs checked identical; then (`--load`) an open-loop load
test against the real server (bench/serve/load.py).

  python -m d2f_jax.main                      # trains the student into workdir/tiny_e2e (once)
  python -m d2f_jax.bench serve [--slots 8,32] [--limit 256] [--load]

A static batch runs until its slowest row is done, so the rows that finish early idle their share of every
forward; the engine refills a finished slot with the next problem. Greedy, the paper's thresholds, the main
job's block size and answer length; compile time excluded from both (each side is warmed up first). Both pad
prompts to the same bucket: a static batch to its longest prompt's, the engine each request to its own. The two
sides alternate `--repeats` times and each side's best time is reported (a shared machine only ever slows a
run down); the ratio of every adjacent pair is listed beside it.
"""

from __future__ import annotations

import argparse
import os
import time

import jax

from d2f_jax.bench.main_job import DEFAULT_CONFIG, DEFAULT_WORKDIR, held_out_prompts, load_student, warm_engine
from d2f_jax.reporting import write_report
from d2f_jax.usage import ArgumentParser


def static_batches(model, prompts, config, slots: int):
  """A timer for `generate` over consecutive batches of `slots` prompts: run() -> (tokens per prompt, seconds).
  Every batch shape (rows x prompt bucket) is compiled first."""
  from d2f_jax.decode import generate
  batches = [prompts[i:i + slots] for i in range(0, len(prompts), slots)]
  shapes = {(len(b), config.bucket(max(map(len, b)))): b for b in batches}
  for batch in shapes.values():
    jax.block_until_ready(generate(model, batch, config).tokens)

  def run():
    start = time.perf_counter()
    results = [generate(model, batch, config) for batch in batches]
    tokens = [row for r in results for row in r.to_lists()]
    return tokens, time.perf_counter() - start
  return run, len(batches)


def engine_run(model, prompts, config, slots: int, steps_per_call: int, max_insert: int):
  """A timer for the engine with `slots` slots over every prompt: run() -> (tokens per prompt, seconds);
  the engine, warmed up (every program compiled, the slots filled and refilled once)."""
  from d2f_jax.serve import RequestSettings
  engine = warm_engine(model, config, slots=slots, max_prompt_len=max(map(len, prompts)),
                       steps_per_call=steps_per_call, max_insert=max_insert)
  settings = RequestSettings(tau_add=config.tau_add, tau_act=config.tau_act, tau_conf=config.tau_conf)
  engine.complete(prompts[:slots + 1], settings)

  def run():
    start = time.perf_counter()
    done = engine.complete(prompts, settings)
    return [c.tokens for c in done], time.perf_counter() - start
  return run, engine


def side_by_side(static, engine, repeats: int):
  """Alternate the two timers `repeats` times (a busy machine slows both alike): (every run of both gave the
  first static run's tokens, static seconds, engine seconds), the seconds one per repeat."""
  want, static_s, engine_s, identical = None, [], [], True
  for _ in range(repeats):
    for timer, times in ((static, static_s), (engine, engine_s)):
      tokens, seconds = timer()
      want = tokens if want is None else want
      identical &= tokens == want
      times.append(seconds)
  return want, identical, static_s, engine_s


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
  p.add_argument("--config", default=DEFAULT_CONFIG,
                 help="the main job's config, as `python -m d2f_jax.main` took it (e.g. configs/tiny_e2e.py:long)")
  p.add_argument("--versus", default=None, choices=("ar",),
                 help="ar: the D2F engine in each throughput mode against the AR engine (bench/serve/versus.py)")
  p.add_argument("--query_limits", type=_sizes, default=None,
                 help="--versus: the D2F modes' query limits (default: the config's mode_sweep at the decode block)")
  p.add_argument("--slots", type=_sizes, default="8,32", help="engine slots = static batch sizes, comma-separated")
  p.add_argument("--limit", type=int, default=256, help="held-out problems")
  p.add_argument("--steps_per_call", type=int, default=4, help="engine D2F steps per device call")
  p.add_argument("--max_insert", type=int, default=8, help="engine: requests prefilled together in one call")
  p.add_argument("--prompt_bucket", type=int, default=32,
                 help="prompts padded to a multiple of this: per batch's longest (static), per request (engine)")
  p.add_argument("--repeats", type=int, default=5,
                 help="timed runs of each side, alternating; the best of each reported")
  p.add_argument("--load", action="store_true", help="also run the open-loop load test against the real server")
  p.add_argument("--soak", type=float, default=None, metavar="MINUTES",
                 help="only: drive the real server with mixed, hostile traffic for MINUTES (bench/serve/soak.py)")
  p.add_argument("--rates", type=_rates, default="4,16,64", help="--load: offered requests per second")
  p.add_argument("--requests", type=int, default=128, help="--load: requests per rate")
  p.add_argument("--json", default=None,
                 help="where the report is written (default results/bench_serve.json, with --versus ar "
                      "results/bench_serve_versus_ar.json)")
  args = p.parse_args(argv)
  if args.soak is not None and not args.soak > 0:
    p.error(f"--soak must be a positive number of minutes, got {args.soak}")
  if args.json is None:
    args.json = ("results/bench_serve_versus_ar.json" if args.versus else
                 "results/bench_serve_soak.json" if args.soak else "results/bench_serve.json")
  return args


def main(argv: list[str]) -> None:
  args = parse_args(argv)
  if args.versus is not None:
    from d2f_jax.bench.serve import versus
    return versus.main(args)
  from d2f_jax.decode import DecodeConfig
  from d2f_jax.e2e.evaluation import decode_block_size
  model, c = load_student(args.workdir, args.config)
  prompts = held_out_prompts(model, c, args.limit)
  tau_add, tau_act, tau_conf = c.d2f_sweep[0]
  config = DecodeConfig(method="d2f", block_size=decode_block_size(c), max_new_tokens=c.max_new_tokens,
                        tau_add=tau_add, tau_act=tau_act, tau_conf=tau_conf, prompt_buckets=args.prompt_bucket)
  if args.soak is not None:
    from d2f_jax.bench.serve import soak as serve_soak
    report = serve_soak.run(os.path.join(args.workdir, "student", "hf"), prompts, config, args.soak,
                            slots=max(args.slots), log_path=os.path.join("results", "bench_serve_soak.log"))
    write_report(args.json, "serve_soak", [serve_soak.summary_row(report)], soak=report)
    if report["unexpected"] or report["server exit"] != 0:
      raise SystemExit(f"the soak saw unexpected outcomes or an unclean exit: {report['unexpected']}, "
                       f"exit {report['server exit']}")
    return
  rows, seconds = [], {}
  for slots in args.slots:
    static, batches = static_batches(model, prompts, config, slots)
    engine, serving = engine_run(model, prompts, config, slots, args.steps_per_call, args.max_insert)
    calls = (serving.advance_calls, serving.insert_calls)
    want, identical, static_s, engine_s = side_by_side(static, engine, args.repeats)
    generated = sum(map(len, want))
    seconds[slots] = {"static": [round(x, 3) for x in static_s], "engine": [round(x, 3) for x in engine_s]}
    static_best, engine_best = min(static_s), min(engine_s)
    rows.append({"slots": slots, "problems": len(prompts), "tokens": generated,
                 "static tokens/s": round(generated / static_best, 1),
                 "engine tokens/s": round(generated / engine_best, 1),
                 "engine / static": round(static_best / engine_best, 3),
                 "per repeat": " ".join(f"{a / b:.2f}" for a, b in zip(static_s, engine_s)),
                 "identical": identical, "static batches": batches,
                 "engine calls (advance / insert)": "{} / {}".format(
                     (serving.advance_calls - calls[0]) // args.repeats,
                     (serving.insert_calls - calls[1]) // args.repeats)})
  extra = {"settings": dict(block_size=config.block_size, max_new_tokens=c.max_new_tokens, tau_add=tau_add,
                            tau_act=tau_act, tau_conf=tau_conf, prompt_bucket=args.prompt_bucket,
                            steps_per_call=args.steps_per_call, max_insert=args.max_insert, repeats=args.repeats,
                            timing="best of the repeats, static and engine alternating"), "seconds": seconds}
  if args.load:
    from d2f_jax.bench.serve import load as serve_load
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
