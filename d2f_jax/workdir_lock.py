"""One writer per directory: a lock file naming the process (pid, host) that works in a training workdir, the
main job's workdir or a convert output, so a second process is refused instead of interleaving its metrics
and checkpoints with the first's.

    with workdir_lock.hold(workdir, what="training workdir"):
        ...

The lock is a file created with O_EXCL (`<dir>/.d2f_jax.lock`, or `<dir>.lock` beside a directory that is
renamed into place). It is removed on any orderly exit (the context's end, an exception, atexit); a lock
left by a killed process of this host (its pid gone) is taken over with a warning. A lock of another host
cannot be checked and is refused, saying which file to delete if that process is gone. Holding a lock
twice in one process nests (the file goes when the last holder lets go).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import socket
import sys
import threading
import time
from typing import Iterator

log = logging.getLogger(__name__)

LOCK_NAME = ".d2f_jax.lock"
_WRITE_GRACE_S = 2.0  # how long an empty lock file may be another process's lock being written

_held: dict[str, int] = {}  # lock file -> holders in this process
_guard = threading.Lock()


class WorkdirLocked(RuntimeError):
  """Another live process holds the directory's lock; the message names its pid, host and the lock file."""


def lock_file(directory, *, beside: bool = False) -> str:
  directory = os.path.abspath(os.fspath(directory)).rstrip(os.sep)
  return directory + ".lock" if beside else os.path.join(directory, LOCK_NAME)


def _host() -> str:
  return socket.gethostname()


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's live process
    return True
  return True


def _read(path: str) -> dict | None:
  """The holder recorded in `path`, {} when it is empty or unreadable, None when it is gone."""
  try:
    with open(path, encoding="utf-8") as f:
      text = f.read()
  except FileNotFoundError:
    return None
  try:
    holder = json.loads(text)
  except json.JSONDecodeError:
    return {}
  return holder if isinstance(holder, dict) else {}


def _create(path: str) -> bool:
  try:
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
  except FileExistsError:
    return False
  with os.fdopen(fd, "w", encoding="utf-8") as f:
    json.dump({"pid": os.getpid(), "host": _host(), "since": time.strftime("%Y-%m-%dT%H:%M:%S"),
               "argv": sys.argv[:8]}, f)
  return True


def _take_over(path: str, why: str) -> None:
  """Move a dead holder's lock out of the way; of two processes racing for it, the rename picks one."""
  stale = f"{path}.stale-{os.getpid()}"
  try:
    os.rename(path, stale)
  except FileNotFoundError:
    return  # another process took it over first; the O_EXCL create decides who gets it
  os.unlink(stale)
  log.warning("taking over the lock %s: %s", path, why)


def acquire(directory, *, what: str = "workdir", beside: bool = False) -> str:
  """Lock `directory` for this process; returns the lock file. WorkdirLocked if a live process holds it."""
  path = lock_file(directory, beside=beside)
  target = path[:-len(".lock")] if beside else os.path.dirname(path)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with _guard:
    if _held.get(path):
      _held[path] += 1
      return path
    deadline = time.monotonic() + _WRITE_GRACE_S
    while not _create(path):
      holder = _read(path)
      if holder is None:
        continue  # released meanwhile: try again
      pid, host = holder.get("pid"), holder.get("host")
      if not isinstance(pid, int) or not isinstance(host, str):
        if time.monotonic() < deadline:  # perhaps a lock being written right now
          time.sleep(0.05)
          continue
        _take_over(path, "it names no process (empty or damaged)")
      elif host == _host() and not _alive(pid):
        _take_over(path, f"its process {pid} on {host} (since {holder.get('since', '?')}) is gone")
      elif host == _host() and pid == os.getpid():
        break  # ours, from an earlier holder of this process that was not released
      else:
        where = "" if host == _host() else (f"; it is on another host, so it cannot be checked from here: if that "
                                            f"process is gone, delete {path}")
        raise WorkdirLocked(f"{what} {target} is in use by process "
                            f"{pid} on host {host} (since {holder.get('since', '?')}, {' '.join(holder.get('argv') or [])}"
                            f"; lock file {path}){where}. Wait for it to finish, or use another directory.")
    _held[path] = 1
  return path


def release(path: str) -> None:
  """Let go of a lock taken by `acquire`; the file is removed when this process's last holder releases it."""
  with _guard:
    count = _held.get(path, 0)
    if count > 1:
      _held[path] = count - 1
      return
    _held.pop(path, None)
    if count and (_read(path) or {}).get("pid") == os.getpid():
      with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


@contextlib.contextmanager
def hold(directory, *, what: str = "workdir", beside: bool = False, enabled: bool = True) -> Iterator[str | None]:
  """Hold the lock of `directory` for the block (enabled=False: no lock, e.g. on hosts other than process 0)."""
  if not enabled:
    yield None
    return
  path = acquire(directory, what=what, beside=beside)
  try:
    yield path
  finally:
    release(path)


@atexit.register
def _release_all() -> None:
  for path in list(_held):
    _held[path] = 1
    release(path)
