"""Multi-host evaluation: which problems each process decodes, and how the shares come back together.

Every process builds the same global list of batches (same prompts, same order, same batch size) and
decodes the batches b with b % count == index on its own devices: the split is a pure function of the
batch list, so a batch holds the same rows (and pads to the same shape) whatever the process count, and
the merged samples equal a single-process run's in content and order. The shares travel as JSON bytes
over `multihost_utils.process_allgather` (no shared file system needed); process 0 writes the files.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable

import numpy as np


@dataclasses.dataclass(frozen=True)
class Processes:
  """This process's place among the evaluating processes. gather: a JSON-able value of this process ->
  every process's value, in process order (called by all processes at the same point)."""

  index: int = 0
  count: int = 1
  gather: Callable[[Any], list[Any]] = lambda value: [value]

  def __post_init__(self):
    if not (isinstance(self.count, int) and self.count >= 1 and isinstance(self.index, int)
            and 0 <= self.index < self.count):
      raise ValueError(f"Processes: need 0 <= index < count, got index={self.index!r}, count={self.count!r}")

  @property
  def is_main(self) -> bool:
    return self.index == 0


def jax_processes() -> Processes:
  """The processes of the running JAX job (one, unless jax.distributed was initialized)."""
  import jax

  if jax.process_count() == 1:
    return Processes()
  return Processes(index=jax.process_index(), count=jax.process_count(), gather=allgather_json)


def allgather_json(value: Any) -> list[Any]:
  """Every process's JSON-able `value` (process order), through two process_allgathers: lengths, then
  the zero-padded UTF-8 bytes."""
  from jax.experimental import multihost_utils

  data = np.frombuffer(json.dumps(value).encode(), np.uint8)
  sizes = np.asarray(multihost_utils.process_allgather(np.array([data.size], np.int32))).reshape(-1)
  padded = np.zeros(int(sizes.max()), np.uint8)
  padded[:data.size] = data
  rows = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(sizes), -1)
  return [json.loads(rows[i, :sizes[i]].tobytes().decode()) for i in range(len(sizes))]


def assign_batches(num_batches: int, index: int, count: int) -> list[int]:
  """The batches process `index` of `count` decodes: every count-th one (round robin balances prompt
  lengths, which grow or shrink along a benchmark file)."""
  if not 0 <= index < count:
    raise ValueError(f"process index {index} is outside [0, {count})")
  return list(range(index, num_batches, count))


def merge_shares(shares: list[dict], total: int, num_batches: int) -> dict:
  """Merge every process's share {"samples": [[item index, sample], ...], "batch_seconds": [[batch,
  seconds], ...], "warmup_batches", "warmup_seconds", "compiled_batches"} into one in item / batch order.
  Each item and batch must come exactly once: a lost or doubled share is an error, never a silent gap."""
  samples: dict[int, dict] = {}
  seconds: dict[int, float] = {}
  for p, share in enumerate(shares):
    for i, sample in share["samples"]:
      if i in samples:
        raise ValueError(f"merge_shares: item {i} came from two processes (second: {p})")
      samples[int(i)] = sample
    for b, s in share["batch_seconds"]:
      if b in seconds:
        raise ValueError(f"merge_shares: batch {b} came from two processes (second: {p})")
      seconds[int(b)] = float(s)
  missing = sorted(set(range(total)) - set(samples))
  missing_batches = sorted(set(range(num_batches)) - set(seconds))
  if missing or missing_batches or len(samples) != total:
    raise ValueError(f"merge_shares: items {missing[:10]} / batches {missing_batches[:10]} came from no process")
  return {"samples": [samples[i] for i in range(total)], "batch_seconds": [seconds[b] for b in range(num_batches)],
          "warmup_batches": sum(s["warmup_batches"] for s in shares),
          "warmup_seconds": max(s["warmup_seconds"] for s in shares),
          "compiled_batches": sum(s["compiled_batches"] for s in shares)}
