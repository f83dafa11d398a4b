"""Distillation step throughput: step time, tokens/s and MFU of the tiny configs on this machine.

  python -m d2f_jax.bench train [--steps 20] [--out results/train.json]
  python -m d2f_jax.bench train --main_job configs/tiny_e2e.py:long   # whole vs length-bucketed batches

MFU is against the device's peak: the table's bf16 peak on TPU / GPU, and on CPU a large f32 matmul measured in
the same run (the tiny configs compute in f32), so the number says how close the step gets to what this
machine's matmul unit can do. Each row times `steps` compiled steps after a warm-up, state donated as in
training; the batches are made beforehand, so input work is not timed.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time

import jax

from d2f_jax.reporting import write_report
from d2f_jax.usage import ArgumentParser
from d2f_jax.train.config import load_config_file
from d2f_jax.train.metrics import PEAK_FLOPS, measure_matmul_flops
from d2f_jax.train.step import compiled_train_step
from d2f_jax.train.trainer import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VARIANTS = ("family=llada", "family=llada,full", "family=dream")


def _peak() -> tuple[float, str]:
  kind = jax.devices()[0].device_kind
  for prefix, flops in PEAK_FLOPS.items():
    if kind.startswith(prefix):
      return flops, f"{prefix} bf16 spec"
  return measure_matmul_flops(n=2048, repeats=10), "measured f32 2048^3 matmul"


def measure(arg: str, steps: int, warmup: int, peak: float, workdir: str) -> dict:
  config = load_config_file(os.path.join(ROOT, "configs", "tiny.py") + ":" + arg)
  config.total_steps = 10 ** 6
  config.data.eval_examples = 0
  config.checkpoint.every = 10 ** 6
  config.progress_bar = False
  trainer = Trainer(config, os.path.join(workdir, arg.replace(",", "_").replace("=", "-")))
  step = compiled_train_step(trainer.spec, trainer.mesh, trainer.rules)
  batches = [trainer.global_batch(next(trainer.data)) for _ in range(warmup + steps)]
  state = trainer.state
  for batch in batches[:warmup]:
    state, metrics = step(state, trainer.frozen, batch)
  jax.block_until_ready(state)
  start = time.perf_counter()
  for batch in batches[warmup:]:
    state, metrics = step(state, trainer.frozen, batch)
  jax.block_until_ready(state)
  seconds = (time.perf_counter() - start) / steps
  trainer.close()
  tokens = config.batch_size * config.data.seq_len
  flops = trainer.flops_per_token * tokens / seconds
  return {"config": f"tiny.py:{arg}", "model": trainer.models.config.family,
          "finetune": config.finetune, "batch x len": f"{config.batch_size}x{config.data.seq_len}",
          "step_ms": seconds * 1e3, "tokens_per_s": tokens / seconds, "model_gflop_s": flops / 1e9,
          "mfu": flops / (peak * jax.device_count()), "loss": float(metrics["loss"])}


def main(argv: list[str]) -> None:
  parser = ArgumentParser("python -m d2f_jax.bench train", __doc__)
  parser.add_argument("--steps", type=int, default=20, help="timed steps per row")
  parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation)")
  parser.add_argument("--variants", default=";".join(VARIANTS), help="';'-separated configs/tiny.py args")
  parser.add_argument("--main_job", default=None, help="instead: this main-job config's stages (configs/"
                      "tiny_e2e.py:long), whole-length against length-bucketed batches (bench/train_buckets.py)")
  parser.add_argument("--out", default=os.path.join("results", "train.json"), help="JSON results file")
  args = parser.parse_args(argv)
  logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every save at INFO
  if args.main_job:
    from d2f_jax.bench import main_job, train_buckets
    config = main_job.load_config(args.main_job)
    with tempfile.TemporaryDirectory(prefix="bench_train_buckets_") as workdir:
      rows = train_buckets.measure(config, args.steps, workdir)
    write_report(args.out, "train_buckets", rows, config=args.main_job, steps=args.steps)
    return
  peak, peak_source = _peak()
  with tempfile.TemporaryDirectory(prefix="bench_train_") as workdir:
    rows = [measure(v, args.steps, args.warmup, peak, workdir) for v in args.variants.split(";") if v]
  write_report(args.out, "train", rows, peak_flops_per_device=peak, peak_source=peak_source, steps=args.steps,
               warmup=args.warmup)
