"""Small helpers shared by the converters: dtype names, atomic output directories, side files."""

from __future__ import annotations

import contextlib
import fnmatch
import os
import shutil
import tempfile
from typing import Iterator

import ml_dtypes
import numpy as np

# Files next to the weights that a converted directory keeps, so tokenizer loading and re-export work:
# tokenizer files, chat templates, generation defaults and the remote code LLaDA / Dream ship with.
AUX_PATTERNS = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                "vocab.json", "vocab.txt", "merges.txt", "added_tokens.json", "chat_template*",
                "generation_config.json", "*.py")


def as_numpy_dtype(dtype) -> np.dtype:
  """np.dtype of a name ('bfloat16', 'float32', ...), numpy / jax dtype; bfloat16 is ml_dtypes'."""
  if dtype is None:
    raise ValueError("dtype is None")
  if isinstance(dtype, str) and dtype in ("bfloat16", "bf16"):
    return np.dtype(ml_dtypes.bfloat16)
  try:
    return np.dtype(dtype)
  except TypeError as e:
    raise ValueError(f"{dtype!r} is not a dtype name (try 'bfloat16', 'float32', 'float16')") from e


def assign(dst: np.ndarray, src: np.ndarray, tile: int = 256) -> None:
  """dst[...] = src, with a cast if dtypes differ; 2-D copies between row- and column-major layouts go
  tile by tile (6x faster than numpy's strided loop for big transposes)."""
  if dst.dtype == src.dtype and dst.dtype.itemsize in (1, 2, 4, 8):  # numpy has no fast path for bfloat16
    as_int = np.dtype(f"u{dst.dtype.itemsize}")
    dst, src = dst.view(as_int), src.view(as_int)
  if dst.ndim == 2 and (dst.strides[0] < dst.strides[1]) != (src.strides[0] < src.strides[1]):
    for i in range(0, dst.shape[0], tile):
      for j in range(0, dst.shape[1], tile):
        dst[i:i + tile, j:j + tile] = src[i:i + tile, j:j + tile]
  else:
    dst[...] = src


def check_out_dir(out_dir: str, overwrite: bool) -> None:
  if os.path.isfile(out_dir):
    raise FileExistsError(f"output {out_dir!r} is a file, expected a directory")
  if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
    raise FileExistsError(f"output directory {out_dir!r} is not empty; pass overwrite=True (--overwrite) to "
                          "replace it")


@contextlib.contextmanager
def atomic_dir(out_dir: str, *, overwrite: bool = False) -> Iterator[str]:
  """Yield a fresh `<out>.tmp-XXXX` directory beside `out_dir`; on success it replaces `out_dir` by rename,
  on failure it is removed, so `out_dir` is never left half written."""
  out = os.path.abspath(os.fspath(out_dir))
  check_out_dir(out, overwrite)
  parent = os.path.dirname(out)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=os.path.basename(out) + ".tmp-", dir=parent)
  try:
    yield tmp
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  check_out_dir(out, overwrite)
  old = None
  if os.path.isdir(out):
    if os.listdir(out):
      old = tempfile.mkdtemp(prefix=os.path.basename(out) + ".old-", dir=parent)
      os.rename(out, os.path.join(old, "d"))
    else:
      os.rmdir(out)
  os.rename(tmp, out)
  if old is not None:
    shutil.rmtree(old, ignore_errors=True)


def aux_files(src_dir: str) -> list[str]:
  """Names of the side files (tokenizer, chat template, remote code) present in `src_dir`."""
  if not src_dir or not os.path.isdir(src_dir):
    return []
  return sorted(e for e in os.listdir(src_dir) if os.path.isfile(os.path.join(src_dir, e))
                and any(fnmatch.fnmatch(e, p) for p in AUX_PATTERNS))


def copy_aux_files(src_dir: str | None, dst_dir: str) -> list[str]:
  """Copy the side files of `src_dir` into `dst_dir`; returns their names."""
  names = aux_files(src_dir) if src_dir else []
  for name in names:
    shutil.copyfile(os.path.join(src_dir, name), os.path.join(dst_dir, name))
  return names
