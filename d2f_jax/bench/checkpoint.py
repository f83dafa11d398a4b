"""What the checkpoint digests cost per save, on the train state of an 8B LoRA run.

  python -m d2f_jax.bench checkpoint [--repeats 3] [--out results/checkpoint.json]

The state has the real shapes of LLaDA-8B with rank-32 LoRA on q, k, v, o (float32 trainable parameters and
AdamW's two moments, as the trainer keeps them; zeros: sha256 costs the same for any bytes). Each row is the
best of `repeats`: the digest of every array (train/digest.py, what `Checkpointer.save` adds), and for scale
the orbax save of the same state to a local temporary directory.
"""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np

from d2f_jax.convert.mapping import lora_shapes
from d2f_jax.models import LLADA_8B, LoraConfig
from d2f_jax.reporting import write_report
from d2f_jax.usage import ArgumentParser
from d2f_jax.train import digest


def lora_state(rank: int = 32, targets=("q", "k", "v", "o")) -> dict:
  shapes = lora_shapes(LLADA_8B, LoraConfig(rank=rank, alpha=float(rank), targets=tuple(targets)))
  params = {path.replace("/", "."): np.zeros(shape, np.float32) for path, shape in shapes.items()}
  return {"step": np.zeros((), np.int32), "params": params,
          "opt": {"mu": {k: np.zeros_like(v) for k, v in params.items()},
                  "nu": {k: np.zeros_like(v) for k, v in params.items()}}}


def _best(fn, repeats: int) -> float:
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    best = min(best, time.perf_counter() - start)
  return best


def main(argv: list[str]) -> None:
  parser = ArgumentParser("python -m d2f_jax.bench checkpoint", __doc__)
  parser.add_argument("--repeats", type=int, default=3, help="timed saves (the fastest is reported)")
  parser.add_argument("--rank", type=int, default=32, help="LoRA rank of the 8B-shaped state")
  parser.add_argument("--no_save", action="store_true", help="time the digests only, not the orbax save")
  parser.add_argument("--out", default=os.path.join("results", "checkpoint.json"), help="where the report is written")
  args = parser.parse_args(argv)
  state = lora_state(args.rank)
  nbytes = sum(a.nbytes for a in _leaves(state))
  seconds = _best(lambda: digest.make(state, {"next_index": 0}), args.repeats)
  rows = [{"what": "sha256 of every array + data position", "state_mb": nbytes / 1e6, "seconds": seconds,
           "gb_per_s": nbytes / seconds / 1e9}]
  if not args.no_save:
    import orbax.checkpoint as ocp
    with tempfile.TemporaryDirectory(prefix="bench_checkpoint_") as root:
      checkpointer = ocp.StandardCheckpointer()
      paths = iter(os.path.join(root, str(i)) for i in range(args.repeats))
      save = _best(lambda: (checkpointer.save(next(paths), state), checkpointer.wait_until_finished()), args.repeats)
      checkpointer.close()
    rows.append({"what": "orbax save of the same state (local disk)", "state_mb": nbytes / 1e6, "seconds": save,
                 "gb_per_s": nbytes / save / 1e9})
  write_report(args.out, "checkpoint", rows, model="LLaDA-8B", lora_rank=args.rank, targets="q,k,v,o",
               repeats=args.repeats, cpus=os.cpu_count())


def _leaves(tree):
  for value in tree.values():
    yield from (_leaves(value) if isinstance(value, dict) else [value])
