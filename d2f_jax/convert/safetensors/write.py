"""Writing safetensors files: a streaming writer (the library has none), one tensor in memory at a time.

`write_file` writes one file to `path.tmp` and renames it, so a reader never sees half a file;
`write_sharded` plans shards (`plan_shards`) and writes the index last; `save_file` writes a dict of arrays.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from typing import Callable, Sequence

import numpy as np

from d2f_jax.convert.safetensors.format import INDEX_SUFFIX, dtype_code


@dataclasses.dataclass(frozen=True)
class TensorSpec:
  name: str
  dtype: np.dtype
  shape: tuple[int, ...]

  @property
  def nbytes(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


def plan_shards(specs: Sequence[TensorSpec], max_shard_bytes: int | None = None,
                num_shards: int | None = None) -> list[list[TensorSpec]]:
  """Split tensors, in order, into shards of at most `max_shard_bytes` (a bigger tensor gets its own
  shard) or into `num_shards` shards of about equal size."""
  total = sum(s.nbytes for s in specs)
  if num_shards is not None:  # cut at equal fractions of the cumulative size: exactly num_shards when possible
    n = max(1, min(num_shards, len(specs)))
    shards: list[list[TensorSpec]] = [[] for _ in range(n)]
    before = 0
    for spec in specs:
      shards[min(n - 1, before * n // max(total, 1))].append(spec)
      before += spec.nbytes
    shards = [s for s in shards if s]
    while len(shards) < n:  # a tensor bigger than total / n left a gap: split the fullest shard
      i = max(range(len(shards)), key=lambda k: len(shards[k]))
      half = len(shards[i]) // 2
      shards[i:i + 1] = [shards[i][:half], shards[i][half:]]
    return shards
  if max_shard_bytes is None or max_shard_bytes <= 0:
    raise ValueError(f"plan_shards needs a positive max_shard_bytes or num_shards, got {max_shard_bytes}")
  shards, current, size = [], [], 0
  for spec in specs:
    if current and size + spec.nbytes > max_shard_bytes:
      shards.append(current)
      current, size = [], 0
    current.append(spec)
    size += spec.nbytes
  if current:
    shards.append(current)
  return shards


def _header_bytes(specs: Sequence[TensorSpec], metadata: dict[str, str] | None) -> bytes:
  header: dict = {"__metadata__": dict(metadata)} if metadata else {}
  offset = 0
  for s in specs:
    header[s.name] = {"dtype": dtype_code(s.dtype), "shape": list(s.shape), "data_offsets": [offset, offset + s.nbytes]}
    offset += s.nbytes
  raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
  raw += b" " * (-len(raw) % 8)  # keep the data section 8-byte aligned, as the reference writer does
  return struct.pack("<Q", len(raw)) + raw


def write_file(path: str, specs: Sequence[TensorSpec], produce: Callable[[TensorSpec], np.ndarray],
               metadata: dict[str, str] | None = None) -> None:
  """Write one safetensors file, asking `produce` for each tensor in order (one in memory at a time).
  Written to `path.tmp` then renamed, so a reader never sees half a file."""
  tmp = path + ".tmp"
  with open(tmp, "wb") as f:
    f.write(_header_bytes(specs, metadata))
    for spec in specs:
      array = produce(spec)
      if tuple(array.shape) != tuple(spec.shape) or np.dtype(array.dtype) != np.dtype(spec.dtype):
        raise ValueError(f"{path}: tensor {spec.name!r} was planned as {np.dtype(spec.dtype)} {list(spec.shape)} "
                         f"but produced as {array.dtype} {list(array.shape)}")
      f.write(memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8)))
      del array
  os.replace(tmp, path)


def save_file(path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
  """Write a dict of arrays as one safetensors file."""
  specs = [TensorSpec(n, np.dtype(a.dtype), tuple(a.shape)) for n, a in tensors.items()]
  write_file(path, specs, lambda s: np.asarray(tensors[s.name]), metadata)


def write_sharded(directory: str, specs: Sequence[TensorSpec], produce: Callable[[TensorSpec], np.ndarray], *,
                  max_shard_bytes: int | None = None, num_shards: int | None = None, prefix: str = "model",
                  metadata: dict[str, str] | None = None, on_written: Callable[[TensorSpec], None] | None = None,
                  ) -> list[str]:
  """Write tensors as `{prefix}.safetensors`, or as `{prefix}-0000k-of-0000n.safetensors` shards plus
  `{prefix}.safetensors.index.json` (written last) when they need more than one shard. Returns file names."""
  shards = plan_shards(specs, max_shard_bytes, num_shards)
  n = len(shards)
  names = [f"{prefix}.safetensors"] if n == 1 else [f"{prefix}-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]

  def produce_and_report(spec: TensorSpec) -> np.ndarray:
    array = produce(spec)
    if on_written is not None:
      on_written(spec)
    return array

  for name, shard in zip(names, shards):
    write_file(os.path.join(directory, name), shard, produce_and_report, metadata)
  if n > 1:
    index = {"metadata": {"total_size": sum(s.nbytes for s in specs)},
             "weight_map": {s.name: name for name, shard in zip(names, shards) for s in shard}}
    tmp = os.path.join(directory, f"{prefix}{INDEX_SUFFIX}.tmp")
    with open(tmp, "w") as f:
      json.dump(index, f, indent=2)
      f.write("\n")
    os.replace(tmp, os.path.join(directory, f"{prefix}{INDEX_SUFFIX}"))
  return names
