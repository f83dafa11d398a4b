"""The main job's training steps with whole-length and with length-bucketed batches, side by side.

  python -m d2f_jax.bench train --main_job configs/tiny_e2e.py:long [--steps 20]

For each stage of the main job's config (AR, the teacher's MDM adaptation, the student's distillation;
random weights, as only the step's cost is measured), the same rows are stepped twice: cut to their length
bucket (`config.length_buckets`, train/buckets.py) and padded back to `seq_len`, what an unbucketed run
computes. Every bucket's program is compiled before the clock starts; the batches are made beforehand.
"""

from __future__ import annotations

import os
import time

import jax
import numpy as np

from d2f_jax.e2e import pipeline
from d2f_jax.train.step import compiled_train_step
from d2f_jax.train.trainer import Trainer


def _pad(batch: dict, seq_len: int, eos_id: int) -> dict:
  tokens = np.asarray(batch["tokens"])
  whole = np.full((tokens.shape[0], seq_len), eos_id, np.int32)  # [B, seq_len]
  whole[:, :tokens.shape[1]] = tokens
  return {"tokens": whole, "prompt_len": batch["prompt_len"]}


def _time(trainer: Trainer, batches: list[dict]) -> float:
  """Seconds a step, over `batches`, after one untimed step per distinct length (its compile)."""
  step = compiled_train_step(trainer.spec, trainer.mesh, trainer.rules)
  state = trainer.state
  arrays = [trainer.global_batch(b) for b in batches]
  for length in sorted({a["tokens"].shape[1] for a in arrays}):
    state, _ = step(state, trainer.frozen, next(a for a in arrays if a["tokens"].shape[1] == length))
  jax.block_until_ready(state)
  start = time.perf_counter()
  for batch in arrays:
    state, _ = step(state, trainer.frozen, batch)
  jax.block_until_ready(state)
  trainer.state = state
  return (time.perf_counter() - start) / len(arrays)


def measure(c, steps: int, workdir: str) -> list[dict]:
  if not c.get("length_buckets"):
    raise ValueError("the main job's config has no length_buckets (config.length_buckets); nothing to compare")
  tokenizer_dir, data_path = pipeline.write_data(c, workdir)  # the main job's own training rows
  rows = []
  for name, _, kw in pipeline.stages(c):
    kw = {k: v for k, v in kw.items() if k != "init"}
    config = pipeline.stage_config(c, data_path=data_path, tokenizer_dir=tokenizer_dir, **kw)
    config.update(dict(progress_bar=False, export=False))
    config.checkpoint.every = 10 ** 6
    trainer = Trainer(config, os.path.join(workdir, name))
    try:
      cut = [next(trainer.data) for _ in range(steps)]
      eos = trainer.models.config.eos_token_id
      whole = [_pad(b, c.seq_len, eos) for b in cut]
      bucketed_s, whole_s = _time(trainer, cut), _time(trainer, whole)
    finally:
      trainer.close()
    positions = float(np.mean([b["tokens"].shape[1] for b in cut]))
    rows.append({"stage": name, "objective": config.objective, "batch": c.batch_size,
                 "whole_len": c.seq_len, "bucketed_mean_len": round(positions, 1),
                 "whole_ms": whole_s * 1e3, "bucketed_ms": bucketed_s * 1e3, "speedup": whole_s / bucketed_s})
  return rows
