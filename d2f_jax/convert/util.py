"""Small helpers shared by the converters: dtype names, atomic output directories, side files.

Output directories are built as `<out>.tmp-<host>-<pid>-XXXX` beside `<out>` and renamed into place; on an
error (or a SIGTERM the CLI turns into an exception) the temp dir is removed, and a temp dir left by a
process that was killed outright (SIGKILL, power loss) is removed by the next conversion to the same
`<out>` once its pid is dead on this host.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import logging
import os
import re
import shutil
import socket
import tempfile
from typing import Iterator

from d2f_jax.convert.errors import ConvertError

log = logging.getLogger(__name__)

import ml_dtypes
import numpy as np

# Files next to the weights that a converted directory keeps, so tokenizer loading and re-export work:
# tokenizer files, chat templates, generation defaults and the remote code LLaDA / Dream ship with.
AUX_PATTERNS = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                "vocab.json", "vocab.txt", "merges.txt", "added_tokens.json", "chat_template*",
                "generation_config.json", "*.py")


def missing_file_error(path: str, what: str) -> FileNotFoundError:
  """Why `path` cannot be opened, in words: a symlink loop or a dangling symlink is said so (both used to be
  reported as "does not exist", sending the user to look for a file that is there)."""
  if os.path.islink(path):
    try:
      os.stat(path)
    except OSError as e:
      if e.errno == errno.ELOOP:
        return FileNotFoundError(f"{path} is a symlink loop (it points to {os.readlink(path)!r}, which leads back "
                                 f"to itself): {what} cannot be read through it")
      return FileNotFoundError(f"{path} is a symlink to {os.readlink(path)!r}, which does not exist")
  return FileNotFoundError(f"{what} {path!r} does not exist")


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


def check_apart(out_dir, sources: dict[str, str | None], out_flag: str = "--out") -> None:
  """Refuse an output that is, lies inside, or contains one of the inputs (`{flag: path}`): replacing it
  would delete the source checkpoint."""
  out = os.path.realpath(os.fspath(out_dir))
  for flag, source in sources.items():
    if source is None:
      continue
    src = os.path.realpath(os.fspath(source))
    if out == src:
      why = "is the same directory as"
    elif out.startswith(src.rstrip(os.sep) + os.sep):
      why = "lies inside"
    elif src.startswith(out.rstrip(os.sep) + os.sep):
      why = "contains"
    else:
      continue
    raise ConvertError(f"{out_flag} {out_dir!r} {why} {flag} {source!r}; writing there would replace the source. "
                       "Choose an output directory outside it")


def _host() -> str:
  return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # exists, owned by someone else
    return True
  return True


def remove_stale_temp_dirs(out_dir: str) -> list[str]:
  """Remove `<out>.tmp-<host>-<pid>-*` / `<out>.old-...` left by dead processes of this host; returns them."""
  out = os.path.abspath(os.fspath(out_dir))
  parent, base = os.path.dirname(out), os.path.basename(out)
  if not os.path.isdir(parent):
    return []
  pattern = re.compile(re.escape(base) + r"\.(?:tmp|old)-(?P<host>[A-Za-z0-9_.]+)-(?P<pid>\d+)-[A-Za-z0-9_]+$")
  removed = []
  for entry in sorted(os.listdir(parent)):
    m = pattern.match(entry)
    if m is None or m.group("host") != _host() or _pid_alive(int(m.group("pid"))):
      continue
    path = os.path.join(parent, entry)
    log.warning("removing %s, left behind by process %s that no longer runs (an interrupted conversion)", path,
                m.group("pid"))
    shutil.rmtree(path, ignore_errors=True)
    removed.append(path)
  return removed


@contextlib.contextmanager
def atomic_dir(out_dir: str, *, overwrite: bool = False) -> Iterator[str]:
  """Yield a fresh `<out>.tmp-<host>-<pid>-XXXX` directory beside `out_dir`; on success it replaces `out_dir` by
  rename, on failure (any exception, including the CLI's SIGTERM) it is removed, so `out_dir` is never left
  half written. Stale temp dirs of dead processes are removed first."""
  out = os.path.abspath(os.fspath(out_dir))
  check_out_dir(out, overwrite)
  parent = os.path.dirname(out)
  os.makedirs(parent, exist_ok=True)
  remove_stale_temp_dirs(out)
  tag = f"{_host()}-{os.getpid()}-"
  tmp = tempfile.mkdtemp(prefix=os.path.basename(out) + ".tmp-" + tag, dir=parent)
  try:
    yield tmp
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  check_out_dir(out, overwrite)
  old = None
  if os.path.isdir(out):
    if os.listdir(out):
      old = tempfile.mkdtemp(prefix=os.path.basename(out) + ".old-" + tag, dir=parent)
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
