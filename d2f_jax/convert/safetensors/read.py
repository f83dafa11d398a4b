"""Reading safetensors files through the `safetensors` library: validated headers, then tensors by row chunks.

`read_header` first checks the header itself (so errors name the file and the tensor), then has the
library validate it (it refuses overlapping, shifted or gapped `data_offsets` and files it does not fully
cover); tensors are then read with `safe_open(framework="np")` + `get_slice` (ml_dtypes gives bf16), row
chunk by row chunk, reopening the file per chunk: the library maps the file, and mapped pages count in the
converter's RSS until the handle is dropped, so at most one chunk's pages stay mapped.

`import safetensors` below is the third-party library (imports are absolute); callers import this package,
d2f_jax.convert.safetensors, whose __init__ gathers this reader, the format (format.py) and the writer (write.py).
"""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import safetensors

from d2f_jax.convert.safetensors.format import (DTYPE_CODES, DTYPES, INDEX_SUFFIX, SINGLE_FILE, SafetensorsError,
                                                TensorInfo)
from d2f_jax.convert.util import missing_file_error

__all__ = ["READ_CHUNK_BYTES", "read_header", "CheckpointReader", "find_safetensors"]

_MAX_HEADER_BYTES = 100 << 20  # the reference implementation's limit
READ_CHUNK_BYTES = 32 << 20  # bytes of one tensor read (and mapped) at a time


def read_header(path: str) -> tuple[dict[str, TensorInfo], dict[str, str]]:
  """Tensor infos (in file order) and the `__metadata__` of one safetensors file, validated."""
  if not os.path.isfile(path):
    raise missing_file_error(path, "safetensors file")
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    raw = f.read(8)
    if len(raw) < 8:
      raise SafetensorsError(f"{path}: file is {size} bytes, too short for a safetensors header")
    (n,) = struct.unpack("<Q", raw)
    if n > min(size - 8, _MAX_HEADER_BYTES):
      raise SafetensorsError(f"{path}: header length {n} does not fit the file of {size} bytes (corrupt header)")
    try:
      header = json.loads(f.read(n).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
      raise SafetensorsError(f"{path}: header is not valid JSON ({e}) (corrupt header)") from e
  if not isinstance(header, dict):
    raise SafetensorsError(f"{path}: header must be a JSON object, got {type(header).__name__}")
  metadata = header.pop("__metadata__", None) or {}
  if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
    raise SafetensorsError(f"{path}: __metadata__ must map strings to strings, got {metadata!r}")
  base, data_size = 8 + n, size - 8 - n
  infos = {}
  for name, entry in header.items():
    try:
      code, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
      if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (*shape, begin, end)):
        raise TypeError("shape and data_offsets must be non-negative integers")
    except (KeyError, TypeError, ValueError) as e:
      raise SafetensorsError(f"{path}: header entry for tensor {name!r} is malformed: {entry!r}") from e
    if code not in DTYPES:
      raise SafetensorsError(f"{path}: tensor {name!r} has unsupported dtype {code!r}; supported: {sorted(DTYPES)}")
    dtype = DTYPES[code]
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if not 0 <= begin <= end <= data_size or end - begin != expected:
      raise SafetensorsError(
          f"{path}: tensor {name!r} ({code}, shape {list(shape)}) has byte range [{begin}, {end}) but needs "
          f"{expected} bytes inside a data section of {data_size} bytes (corrupt header or truncated file)")
    infos[name] = TensorInfo(name, dtype, shape, path, base + begin, base + end)
  ordered = dict(sorted(infos.items(), key=lambda kv: (kv[1].start, kv[1].end)))
  _check_tiling(path, list(ordered.values()), base, size)
  _library_check(path, ordered)
  return ordered, metadata


def _check_tiling(path: str, infos: list[TensorInfo], base: int, size: int) -> None:
  """Tensors must tile the data section exactly, in offset order: an overlap means two tensors share bytes
  (one of them would load another's weights), a gap or a tail means the offsets were shifted or the file
  was extended. The library refuses these too; this names the tensors."""
  position, previous = base, None
  for info in infos:
    if info.start != position:
      what = "overlap" if info.start < position else "leave a gap after"
      after = f"tensor {previous.name!r} [{previous.start - base}, {previous.end - base})" if previous else \
          "the start of the data section"
      raise SafetensorsError(f"{path}: tensor {info.name!r} bytes [{info.start - base}, {info.end - base}) {what} "
                             f"{after} (invalid data_offsets: corrupt header)")
    position, previous = info.end, info
  if position != size:
    raise SafetensorsError(f"{path}: tensors cover {position - base} bytes of a data section of {size - base} "
                           "(invalid data_offsets, or a truncated or extended file)")


def _library_check(path: str, infos: dict[str, TensorInfo]) -> None:
  """The safetensors library's own validation of the header, and agreement with ours on every tensor."""
  try:
    with safetensors.safe_open(path, framework="np") as f:
      names = set(f.keys())
      for name in names & set(infos):
        sl = f.get_slice(name)
        if tuple(sl.get_shape()) != infos[name].shape or sl.get_dtype() != DTYPE_CODES[infos[name].dtype]:
          raise SafetensorsError(f"{path}: tensor {name!r} reads as {sl.get_dtype()} {sl.get_shape()} through the "
                                 f"safetensors library but {DTYPE_CODES[infos[name].dtype]} {list(infos[name].shape)} "
                                 "through the header (corrupt header)")
  except SafetensorsError:
    raise
  except Exception as e:  # safetensors.SafetensorError and the library's other refusals
    raise SafetensorsError(f"{path}: refused by the safetensors library: {e} (corrupt header or file)") from e
  if names != set(infos):
    raise SafetensorsError(f"{path}: the safetensors library sees tensors {sorted(names ^ set(infos))} differently "
                           "(duplicate names in the header?)")


class CheckpointReader:
  """All tensors of a checkpoint directory or file: one file, or shards named by a `*.safetensors.index.json`.

  `read(name)` returns one tensor (optionally a row range of it), read through the safetensors library in
  row chunks of at most READ_CHUNK_BYTES; no file stays open (or mapped) between reads.
  """

  def __init__(self, path: str):
    path = os.fspath(path)
    self.root = path
    self.infos: dict[str, TensorInfo] = {}
    self.metadata: dict[str, str] = {}
    if os.path.isfile(path):
      self.infos, self.metadata = read_header(path)
      return
    if not os.path.isdir(path):
      raise FileNotFoundError(f"checkpoint {path!r} does not exist")
    files = find_safetensors(path)
    if files is None:
      raise FileNotFoundError(f"no safetensors weights in {path!r} (looked for {SINGLE_FILE}, *{INDEX_SUFFIX}, "
                              "*.safetensors)")
    index_file, shard_files = files
    weight_map = _read_index(index_file) if index_file else None
    for shard in shard_files:
      infos, metadata = read_header(shard)
      self.metadata.update(metadata)
      for name, info in infos.items():
        if name in self.infos:
          raise SafetensorsError(f"tensor {name!r} appears in both {self.infos[name].path} and {shard}")
        if weight_map is not None and weight_map.get(name) != os.path.basename(shard):
          raise SafetensorsError(f"{index_file}: tensor {name!r} is in {os.path.basename(shard)} but the index "
                                 f"maps it to {weight_map.get(name)!r}")
        self.infos[name] = info
    if weight_map is not None:
      for name, shard in weight_map.items():
        if name not in self.infos:
          raise SafetensorsError(f"{index_file}: tensor {name!r} is listed for {shard} but absent from that file")

  def __contains__(self, name: str) -> bool:
    return name in self.infos

  def names(self) -> list[str]:
    return list(self.infos)

  def read(self, name: str, out: np.ndarray | None = None, rows: tuple[int, int] | None = None) -> np.ndarray:
    """Tensor `name` (or its leading-axis slice rows=(start, stop)) read into `out` or a new array."""
    if name not in self.infos:
      raise KeyError(f"tensor {name!r} is not in checkpoint {self.root!r}")
    info = self.infos[name]
    lo, hi = (0, info.shape[0] if info.shape else 0) if rows is None else rows
    if rows is not None and (not info.shape or not 0 <= lo <= hi <= info.shape[0]):
      raise ValueError(f"rows {rows} out of range for tensor {name!r} of shape {list(info.shape)}")
    shape = info.shape if rows is None else (hi - lo,) + info.shape[1:]
    if out is None:
      out = np.empty(shape, info.dtype)
    if out.shape != shape or out.dtype != info.dtype or not out.flags.c_contiguous:
      raise ValueError(f"buffer for tensor {name!r} must be C-contiguous {info.dtype} {shape}, got "
                       f"{out.dtype} {out.shape}")
    if not info.shape:  # a scalar has no rows to slice
      with safetensors.safe_open(info.path, framework="np") as f:
        out[...] = f.get_tensor(name)
      return out
    row_bytes = max(1, int(np.prod(info.shape[1:], dtype=np.int64)) * info.dtype.itemsize)
    step = max(1, READ_CHUNK_BYTES // row_bytes)
    flat = out.reshape(hi - lo, -1).view(f"u{info.dtype.itemsize}") if out.size else None
    for start in range(lo, hi, step):
      stop = min(hi, start + step)
      with safetensors.safe_open(info.path, framework="np") as f:  # one chunk's pages mapped at a time
        block = f.get_slice(name)[start:stop]
      if block.dtype != info.dtype or block.shape != (stop - start,) + info.shape[1:]:
        raise SafetensorsError(f"{info.path}: tensor {name!r} rows [{start}, {stop}) read as {block.dtype} "
                               f"{list(block.shape)}, expected {info.dtype} {[stop - start, *info.shape[1:]]}")
      flat[start - lo:stop - lo] = block.reshape(stop - start, -1).view(flat.dtype)
      del block
    return out

  def close(self) -> None:
    """Nothing stays open between reads; kept so readers work as context managers."""

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def find_safetensors(directory: str) -> tuple[str | None, list[str]] | None:
  """(index file or None, shard files) of a directory, or None when it holds no safetensors weights."""
  entries = sorted(os.listdir(directory))
  indexes = [e for e in entries if e.endswith(INDEX_SUFFIX)]
  if SINGLE_FILE in entries and not indexes:
    return None, [os.path.join(directory, SINGLE_FILE)]
  if indexes:
    preferred = f"model{INDEX_SUFFIX}"
    index = os.path.join(directory, preferred if preferred in indexes else indexes[0])
    shards = sorted(set(_read_index(index).values()))
    missing = [s for s in shards if not os.path.isfile(os.path.join(directory, s))]
    if missing:
      raise FileNotFoundError(f"{index} names shard file(s) {missing} that do not exist in {directory}")
    return index, [os.path.join(directory, s) for s in shards]
  files = [os.path.join(directory, e) for e in entries if e.endswith(".safetensors")]
  return (None, files) if files else None


def _read_index(index_file: str) -> dict[str, str]:
  try:
    with open(index_file) as f:
      index = json.load(f)
    weight_map = index["weight_map"]
  except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
    raise SafetensorsError(f"{index_file}: not a safetensors index with a 'weight_map' ({e})") from e
  if not isinstance(weight_map, dict):
    raise SafetensorsError(f"{index_file}: 'weight_map' must map tensor names to files")
  return weight_map
