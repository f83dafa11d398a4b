"""JAX's persistent compilation cache for the command-line programs, on by default on GPU and TPU.

An LLaDA-8B decode or serving program takes minutes to compile on an accelerator host (docs/pods.md: compile
times; the unrolled v5e-8 decode over 20), and every process start would pay it again. With the cache, a
program compiled once by any process on the host (same jax, libtpu / CUDA, program and flags) is read back
from disk in seconds. The key includes everything that changes the executable, so a stale entry is never
used: the worst a cache directory can do is miss.

`--compilation_cache` of generate / evaluate / serve (and `$D2F_COMPILATION_CACHE`) picks the directory:
'auto' = $D2F_COMPILATION_CACHE or ~/.cache/d2f_jax/xla on GPU / TPU, nothing on CPU (its programs compile
in seconds); 'off'; or a directory, on any platform.
"""

from __future__ import annotations

import os

ENV = "D2F_COMPILATION_CACHE"
DEFAULT_DIR = os.path.join("~", ".cache", "d2f_jax", "xla")
CHOICES_HELP = ("persistent XLA compilation cache: 'auto' ($D2F_COMPILATION_CACHE or ~/.cache/d2f_jax/xla on "
                "GPU / TPU, none on CPU), 'off', or a directory (any platform)")
ACCELERATORS = ("gpu", "cuda", "rocm", "tpu")


def cache_dir(flag: str, platform: str, environ=os.environ) -> str | None:
  """The directory `flag` names on `platform` (None: no cache). An empty or 'off' environment variable
  turns the 'auto' cache off as well."""
  if not isinstance(flag, str) or not flag.strip():
    raise ValueError(f"--compilation_cache must be 'auto', 'off' or a directory, got {flag!r}")
  if flag == "off":
    return None
  if flag == "auto":
    if platform not in ACCELERATORS:
      return None
    chosen = environ.get(ENV, DEFAULT_DIR)
    if not chosen.strip() or chosen == "off":
      return None
    return os.path.abspath(os.path.expanduser(chosen))
  return os.path.abspath(os.path.expanduser(flag))


def enable(flag: str, platform: str | None = None) -> str | None:
  """Point JAX's persistent compilation cache at `flag`'s directory (created if missing); returns it, or
  None when `flag` leaves the cache off. `platform`: default the default backend's. Call once, before the
  first compile; a directory that cannot be made is an error naming it (not a silent recompile each start)."""
  import jax

  path = cache_dir(flag, jax.default_backend() if platform is None else platform)
  if path is None:
    return None
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise ValueError(f"--compilation_cache {path}: cannot create the directory ({e.strerror})") from e
  if not os.access(path, os.W_OK):
    raise ValueError(f"--compilation_cache {path}: the directory is not writable")
  jax.config.update("jax_compilation_cache_dir", path)
  # Cache every program that took over a second to compile (jax's default); small ones are not worth a file.
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
  return path
