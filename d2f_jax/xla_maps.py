"""Keep a long-lived process under Linux's cap on memory mappings, which XLA:CPU's compiled programs fill.

XLA:CPU (jaxlib 0.10) maps every compiled kernel into memory on its own: one decode program of a tiny model
holds about 1,000 mappings, one engine warm-up 2,700, and JAX keeps every compiled program while its function
lives. Linux caps a process at `vm.max_map_count` mappings (65530 by default). A process that keeps compiling
new programs (a test worker, a sweep over decode settings, the main job's evaluation) reaches the cap after
about 60 decode programs; the next compile cannot allocate ("LLVM compilation error: Cannot allocate memory",
"Failed to materialize symbols"), and raising that error crashes the process inside libgcc's unwinder
(SIGSEGV or SIGABRT in backend_compile). Reproduced by compiling `generate` at 60 distinct max_new_tokens in
one process (tests/test_xla_maps.py).

`ensure_headroom` frees JAX's compiled programs (`jax.clear_caches`) when the process comes within `reserve`
mappings of the cap: they recompile when next called, which costs time, never results. It is called before
the library compiles (generate, the serving engine's warm-up, a trainer's start) and by the test suite between
tests. Not Linux, or /proc unreadable: nothing to do.
"""

from __future__ import annotations

import gc
import logging
import os
import time

log = logging.getLogger(__name__)

RESERVE = 16384  # mappings the compiles until the next check may add (an 8B model's program: a few thousand)
LIMIT_ENV = "D2F_MAX_MAP_COUNT"  # a lower cap to act on than the kernel's (tests use it to act early)
_MIN_INTERVAL_S = 0.25  # a compile adds at most a few thousand mappings in this time: skip closer checks
_last_check = [0.0]


def mapping_count() -> int | None:
  """Memory mappings this process holds now (lines of /proc/self/maps); None where there is no /proc."""
  try:
    with open("/proc/self/maps", "rb") as f:
      return f.read().count(b"\n")
  except OSError:
    return None


def mapping_limit() -> int | None:
  """The cap to stay under: $D2F_MAX_MAP_COUNT when set, else the kernel's vm.max_map_count (None if unknown)."""
  if os.environ.get(LIMIT_ENV):
    try:
      return int(os.environ[LIMIT_ENV])
    except ValueError:
      raise ValueError(f"${LIMIT_ENV} must be an integer, got {os.environ[LIMIT_ENV]!r}") from None
  try:
    with open("/proc/sys/vm/max_map_count") as f:
      return int(f.read())
  except (OSError, ValueError):
    return None


def ensure_headroom(reserve: int = RESERVE, *, force: bool = False) -> bool:
  """Free JAX's compiled programs when fewer than `reserve` mappings remain under the cap; whether it freed.

  Checks at most every 0.25 s unless `force`. Raises RuntimeError when even freeing them leaves too little
  room: the next compile would crash the process, and the message says how to raise the cap."""
  now = time.monotonic()
  if not force and now - _last_check[0] < _MIN_INTERVAL_S:
    return False
  _last_check[0] = now
  limit, count = mapping_limit(), mapping_count()
  if limit is None or count is None or count < limit - reserve:
    return False
  import jax
  jax.clear_caches()
  gc.collect()
  after = mapping_count() or 0
  log.warning("freed JAX's compiled programs: this process held %d of the %d memory mappings allowed "
              "(vm.max_map_count, or $%s), %d after; XLA:CPU maps each compiled kernel on its own and crashes "
              "when it runs out; they recompile when next called", count, limit, LIMIT_ENV, after)
  if after >= limit - reserve // 4:
    raise RuntimeError(f"this process holds {after} of the {limit} memory mappings allowed even after freeing "
                       f"JAX's compiled programs; the next XLA compile would crash it: raise the cap "
                       f"(sudo sysctl -w vm.max_map_count=262144) or hold fewer arrays")
  return True
