"""Command line benchmark evaluation: `python -m d2f_jax.evaluate --model PATH --task gsm8k|humaneval ...`.

Loads the model, runs the task with the chosen decoder (d2f by default, the paper's thresholds) and writes
results.json (score, tokens/s, tokens per forward, latency, every setting) and samples.jsonl (one line
per problem) to --out. The work is done in d2f_jax/evals/; this file only parses flags.

`--mesh data=2,tensor=4` decodes on that mesh of this process's devices. Under jax.distributed
(`--distributed auto` detects SLURM, Open MPI, TPU pod slices) every process takes every N-th batch on its
own devices and process 0 writes the merged files.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

from d2f_jax.decode.flags import (add_decode_flags, add_device_flags, add_model_flags, check_model_flags,
                                  decode_config_from_flags, setup_devices)
from d2f_jax.evals.runner import TASKS, WARMUPS
from d2f_jax.tasks.arithmetic import STYLES, ArithmeticTask
from d2f_jax.usage import ArgumentParser, UsageError, command

ARITHMETIC = ArithmeticTask().options()  # the task's fields and defaults: one --arithmetic_<field> flag each
ARITHMETIC_HELP = {"seed": "the generator's seed (the config's seed)",
                   "train": "training problems drawn first (the held-out ones are the next, unseen ones)",
                   "test": "held-out problems", "min_steps": "fewest operations in a problem",
                   "max_steps": "most operations in a problem",
                   "style": "the worked-solution format trained on (recorded only: prompts and answers are the "
                            "same in both)"}


def build_parser() -> argparse.ArgumentParser:
  p = ArgumentParser("python -m d2f_jax.evaluate", __doc__)
  add_model_flags(p)
  p.add_argument("--task", required=True, choices=sorted(TASKS), help="the benchmark")
  p.add_argument("--data", default=None,
                 help="benchmark file (default: <task file> in $D2F_DATA_DIR, else ~/.local/share/d2f_jax)")
  p.add_argument("--limit", type=int, default=None, help="evaluate the first N problems only")
  p.add_argument("--out", default=None, help="output directory (default results/evals/<task>_<method>_<time>)")
  p.add_argument("--batch_size", type=int, default=1, help="prompts per generate call (the paper uses 1)")
  p.add_argument("--warmup", default="shapes", choices=WARMUPS,
                 help="untimed compile calls: one per prompt shape, the first batch only, or none")
  p.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template")
  p.add_argument("--add_bos", action="store_true", help="prepend the model's BOS id to every prompt")
  p.add_argument("--seed", type=int, default=0, help="sampling seed (with --temperature > 0)")
  g = p.add_argument_group("gsm8k")
  g.add_argument("--n_shot", type=int, default=4, help="few-shot exemplars in each prompt")
  g.add_argument("--fewshot_data", default=None, help="draw exemplars from this GSM8K-format file "
                 "(seeded) instead of the built-in ones")
  g.add_argument("--fewshot_seed", type=int, default=1234, help="seed of the --fewshot_data draw")
  a = p.add_argument_group("arithmetic (the main job's held-out set; defaults: configs/tiny_e2e.py; its :long variant "
                           "is --arithmetic_min_steps 4 --arithmetic_max_steps 7 --arithmetic_test 64 "
                           "--arithmetic_style verbose)")
  for name, value in ARITHMETIC.items():
    a.add_argument(f"--arithmetic_{name}", type=type(value), default=value,
                   choices=STYLES if name == "style" else None, help=ARITHMETIC_HELP[name])
  h = p.add_argument_group("humaneval execution")
  h.add_argument("--exec_timeout", type=float, default=10.0, help="seconds per program")
  h.add_argument("--exec_memory_mb", type=int, default=1024, help="memory limit per program")
  h.add_argument("--exec_workers", type=int, default=2, help="programs run at once")
  h.add_argument("--isolation", default="bubblewrap", choices=("bubblewrap", "process"),
                 help="bubblewrap namespaces (default; an error where they cannot run) or 'process', the "
                      "explicit fallback that does not contain hostile code")
  d = p.add_argument_group("decoding (see d2f_jax.decode.DecodeConfig)")
  add_decode_flags(d)
  add_device_flags(p.add_argument_group("devices"))
  return p


def default_out_dir(task: str, method: str) -> str:
  """results/evals/<task>_<method>_<time>_<microseconds>-<pid>: two evaluations started in the same second
  (a one-second name made them share a directory and overwrite each other's samples) get their own."""
  now = time.time()
  stamp = time.strftime("%Y%m%d_%H%M%S", time.localtime(now))
  return f"results/evals/{task}_{method}_{stamp}_{int(now * 1e6) % 1_000_000:06d}-{os.getpid()}-{next(_RUNS)}"


_RUNS = itertools.count()


def make_task(args):
  from d2f_jax.evals.runner import make_task as by_name
  options = {name: getattr(args, f"arithmetic_{name}") for name in ARITHMETIC}
  if args.task == "arithmetic":  # the main job's held-out set, the config's task fields as flags
    if args.data:
      raise UsageError("--data is not used by --task arithmetic: its problems come from the task's generator")
    return by_name("arithmetic", **options)
  changed = [f"--arithmetic_{k}" for k, v in options.items() if v != ARITHMETIC[k]]
  if changed:
    raise UsageError(f"{', '.join(changed)} only apply to --task arithmetic, not --task {args.task}")
  if args.task == "gsm8k":
    return by_name("gsm8k", path=args.data, n_shot=args.n_shot, fewshot_path=args.fewshot_data,
                   fewshot_seed=args.fewshot_seed)
  from d2f_jax.evals.sandbox import BubblewrapUnavailable, Sandbox
  try:
    sandbox = Sandbox(isolation=args.isolation, timeout_s=args.exec_timeout, memory_mb=args.exec_memory_mb)
  except (ValueError, BubblewrapUnavailable) as e:
    raise UsageError(f"bad execution option: {e}") from e
  return by_name("humaneval", path=args.data, sandbox=sandbox, workers=args.exec_workers)


@command
def main(argv: list[str] | None = None) -> dict:
  args = build_parser().parse_args(argv)
  if args.limit is not None and args.limit < 1:
    raise UsageError(f"--limit must be a positive int, got {args.limit}")
  config = decode_config_from_flags(args)
  check_model_flags(args)
  mesh = setup_devices(args, local=True)  # before any other JAX call (jax.distributed)
  task = make_task(args)
  try:  # read the benchmark before the (slow) model load, so a bad file fails at once
    task.load(args.limit)
  except (FileNotFoundError, ValueError) as e:
    raise UsageError(f"cannot read the {args.task} data: {e}") from e
  out = args.out or default_out_dir(args.task, args.method)

  from d2f_jax.decode.methods import check_method_fits, model_attention
  from d2f_jax.evals.runner import run_benchmark

  from d2f_jax.api import load_from_flags
  model = load_from_flags(args, mesh)
  try:
    check_method_fits(model.config, config, model_attention(model))
  except ValueError as e:
    raise UsageError(f"--method {args.method} does not fit {args.model}: {e}") from e
  from d2f_jax.decode.limits import DecodeInputError
  try:
    results = run_benchmark(model, task, config, batch_size=args.batch_size, limit=args.limit, chat=args.chat,
                            add_bos=args.add_bos, warmup=args.warmup, seed=args.seed, out_dir=out)
  except DecodeInputError as e:  # a problem's prompt too long for the model, the cache past the memory budget
    raise UsageError(f"{args.task} on {args.model}: {e}") from None
  if "files" in results:  # process 0: the score on stdout (progress and the rest of the log go to stderr)
    print(summary(results), flush=True)
    print(f"wrote {results['files']['results']} and {results['files']['samples']}", file=sys.stderr)
  return results


def summary(results: dict) -> str:
  """One line: score with its standard error, throughput and where the files are."""
  speed = results["speed"]
  per = lambda v, fmt: "n/a" if v is None else format(v, fmt)  # noqa: E731
  stderr = "" if results["score_stderr"] is None else f" +- {results['score_stderr']:.2f}"
  return (f"{results['task']} {results['metric']} {results['score']:.2f}{stderr} "
          f"({results['correct']}/{results['total']}), {per(speed['tokens_per_s'], '.1f')} tokens/s, "
          f"{per(speed['tokens_per_forward'], '.2f')} tokens/forward; {results['files']['results']}")


if __name__ == "__main__":
  main(sys.argv[1:])
