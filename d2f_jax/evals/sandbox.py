"""Run generated Python in a limited subprocess: the execution sandbox behind HumanEval pass@1.

Layers, strongest first:
  - OS resource limits, set by the child's launcher before it reads the program: address space
    (RLIMIT_AS), CPU seconds (RLIMIT_CPU), size of any file written (RLIMIT_FSIZE), no core files, and a
    process count (RLIMIT_NPROC) only when the child runs as `nobody`: root ignores it, and for any other
    user it would count every process that user already runs. Not a `preexec_fn`: that forces a plain
    fork() of the parent, which runs JAX's threads and may deadlock in the child (JAX warns so); set
    first thing in the launcher, soft = hard, they bind the program just the same;
  - a wall-clock timeout that kills the child's whole process group (the child starts a new session);
  - a private network namespace (`unshare -n`: no interface but a downed loopback), used when running
    as root and the tool works on this host (containers often forbid it);
  - running as `nobody` when the parent is root and the interpreter is reachable by other users, so the
    host's file permissions apply (the repository stays read-only; world-writable /tmp does not);
  - a fresh temporary working directory, deleted afterwards, and `python -I -B` (no user site-packages,
    no PYTHON* variables, no working directory on sys.path, no .pyc files);
  - Python-level guards (sandbox_launcher.py): writes outside the directory, sockets, new processes.

The Python guards are NOT a security boundary (ctypes or introspection undo them), and nor is the whole
against deliberately hostile code: there is no seccomp filter or filesystem namespace, and the child stays
root when privileges cannot be dropped. It is meant for model-generated code, which is buggy rather than
malicious; run benchmarks of untrusted origin inside a throwaway VM or container as well.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import math
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_LAUNCHER = Path(__file__).with_name("sandbox_launcher.py")
NOBODY = (65534, 65534)


@dataclasses.dataclass(frozen=True)
class ExecResult:
  """Outcome of one program: 'passed' (exit 0 after running to the end), 'failed' or 'timeout'."""

  status: str
  returncode: int | None
  seconds: float
  stdout: str
  stderr: str

  @property
  def passed(self) -> bool:
    return self.status == "passed"

  @property
  def reason(self) -> str:
    """One line saying why a run did not pass: the exception, the signal or the timeout."""
    if self.status == "passed":
      return "passed"
    if self.status == "timeout":
      return f"timed out after {self.seconds:.1f}s"
    if self.returncode is not None and self.returncode < 0:
      try:
        name = signal.Signals(-self.returncode).name
      except ValueError:
        name = f"signal {-self.returncode}"
      hint = {"SIGXCPU": " (CPU time limit)", "SIGXFSZ": " (file size limit)"}.get(name, "")
      return f"killed by {name}{hint}"
    lines = [line for line in self.stderr.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else f"exit code {self.returncode}"


@functools.lru_cache(maxsize=None)
def network_namespace_available() -> bool:
  """True when this process may create a network namespace (root, `unshare` present and permitted)."""
  tool = shutil.which("unshare")
  if os.geteuid() != 0 or tool is None:
    return False
  try:
    return subprocess.run([tool, "-n", "--", "true"], capture_output=True, timeout=10).returncode == 0
  except (OSError, subprocess.TimeoutExpired):
    return False


def world_executable(path: str) -> bool:
  """True when a user without privileges could run `path`: every directory above it searchable by others."""
  real = Path(os.path.realpath(path))
  try:
    if not real.stat().st_mode & stat.S_IXOTH:
      return False
    return all(parent.stat().st_mode & stat.S_IXOTH for parent in real.parents)
  except OSError:
    return False


@dataclasses.dataclass
class Sandbox:
  """Limits for running one program; `run(source)` executes it, `run_many` several in parallel.

  drop_privileges / network_namespace: None = use them when available here, True = require them (error
  if impossible), False = never. python: the interpreter (default: this one).
  """

  timeout_s: float = 10.0
  memory_mb: int = 1024
  file_mb: int = 16
  max_processes: int = 32
  python: str | None = None
  drop_privileges: bool | None = None
  network_namespace: bool | None = None
  guards: bool = True
  output_chars: int = 4000

  def __post_init__(self):
    if (isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or not self.timeout_s > 0
        or math.isinf(self.timeout_s)):
      raise ValueError(f"Sandbox.timeout_s must be a positive finite number of seconds, got {self.timeout_s!r}")
    for name in ("memory_mb", "file_mb", "max_processes"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"Sandbox.{name} must be a positive int, got {value!r}")
    self.python = self.python or sys.executable
    if shutil.which(self.python) is None:
      raise ValueError(f"Sandbox.python {self.python!r} is not an executable interpreter")
    root = os.geteuid() == 0
    if self.drop_privileges and not root:
      raise ValueError("Sandbox.drop_privileges=True needs root (it switches the child to nobody)")
    if self.drop_privileges and not world_executable(self.python):
      raise ValueError(f"Sandbox.drop_privileges=True but nobody cannot run {self.python!r} (a directory "
                       "above it is not searchable by others); pass python='/usr/bin/python3' or similar")
    if self.network_namespace and not network_namespace_available():
      raise ValueError("Sandbox.network_namespace=True but `unshare -n` is unavailable or not permitted here")
    if self.drop_privileges is None:
      self.drop_privileges = root and world_executable(self.python)
    if self.network_namespace is None:
      self.network_namespace = network_namespace_available()

  def isolation(self) -> dict:
    """Which layers this sandbox applies, for the results file."""
    return {"timeout_s": self.timeout_s, "memory_mb": self.memory_mb, "cpu_s": self._cpu_seconds(),
            "file_mb": self.file_mb, "max_processes": self.max_processes if self.drop_privileges else None,
            "network_namespace": self.network_namespace, "run_as_nobody": self.drop_privileges,
            "python_guards": self.guards, "python": self.python}

  def _cpu_seconds(self) -> int:
    return int(math.ceil(self.timeout_s)) + 1

  def _limits(self) -> dict:
    """RLIMIT_* values the launcher sets before anything else (soft, or [soft, hard])."""
    return {"RLIMIT_AS": self.memory_mb << 20, "RLIMIT_CPU": [self._cpu_seconds(), self._cpu_seconds() + 1],
            "RLIMIT_FSIZE": self.file_mb << 20, "RLIMIT_CORE": 0,
            "RLIMIT_NPROC": self.max_processes if self.drop_privileges else None}

  def run(self, source: str) -> ExecResult:
    """Run `source` as __main__ in a fresh directory; 'passed' only if it runs to its end."""
    outer = tempfile.mkdtemp(prefix="d2f_sandbox_")
    try:
      os.chmod(outer, 0o711)  # others may pass through to work/ but not list or touch the output files
      work = os.path.join(outer, "work")
      os.mkdir(work, 0o700)
      Path(work, "program.py").write_text(source, encoding="utf-8")
      shutil.copyfile(_LAUNCHER, os.path.join(work, "launcher.py"))
      options = {"uid": None, "gid": None, "guards": self.guards, "limits": self._limits()}
      if self.drop_privileges:
        options["uid"], options["gid"] = NOBODY
        for name in (work, os.path.join(work, "program.py"), os.path.join(work, "launcher.py")):
          os.chown(name, *NOBODY)
      command = [self.python, "-I", "-B", "launcher.py", json.dumps(options)]
      if self.network_namespace:
        command = [shutil.which("unshare"), "-n", "--"] + command
      env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": work, "TMPDIR": work}
      with open(os.path.join(outer, "stdout"), "wb") as out, open(os.path.join(outer, "stderr"), "wb") as err:
        return self._execute(command, work, env, out, err, outer)
    finally:
      shutil.rmtree(outer, ignore_errors=True)

  def _execute(self, command, work, env, out, err, outer) -> ExecResult:
    start = time.perf_counter()
    proc = subprocess.Popen(command, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                            start_new_session=True, close_fds=True)
    timed_out = False
    try:
      proc.wait(timeout=self.timeout_s)
    except subprocess.TimeoutExpired:
      timed_out = True
    finally:
      _kill_group(proc.pid)  # the timed-out program, and anything it left running either way
      proc.wait()
    seconds = time.perf_counter() - start
    status = "timeout" if timed_out else ("passed" if proc.returncode == 0 else "failed")
    return ExecResult(status=status, returncode=proc.returncode, seconds=seconds,
                      stdout=_tail(os.path.join(outer, "stdout"), self.output_chars),
                      stderr=_tail(os.path.join(outer, "stderr"), self.output_chars))

  def run_many(self, sources: list[str], workers: int = 1) -> list[ExecResult]:
    """Run programs `workers` at a time; results in the order of `sources`."""
    if workers <= 1:
      return [self.run(s) for s in sources]
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
      return list(pool.map(self.run, sources))


def _kill_group(pgid: int) -> None:
  try:
    os.killpg(pgid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass


def _tail(path: str, chars: int) -> str:
  with open(path, "rb") as f:
    f.seek(0, os.SEEK_END)
    size = f.tell()
    f.seek(max(0, size - 4 * chars))
    return f.read().decode("utf-8", errors="replace")[-chars:]
