"""Run untrusted generated code and decide pass/fail where that code cannot reach: HumanEval's sandbox.

Isolation (`Sandbox(isolation=...)`, recorded in results.json through `describe()`):
  - "bubblewrap" (default): every process in fresh user/pid/mount/network/ipc/uts namespaces with a
    read-only minimal root, a private size-capped tmpfs, user 65534 and rlimits (sandbox_bwrap.py). If
    bwrap cannot run here, constructing the sandbox raises BubblewrapUnavailable; nothing falls back
    silently.
  - "process": the fallback for hosts without namespaces (some Colab runtimes), chosen explicitly and
    warned about: rlimits, a killed process group, `nobody` when the evaluator is root and the
    interpreter is reachable, `unshare -n` when permitted, Python-level guards. Hostile code gets out.

A test's verdict (`run_test`, HumanEval) comes from two sandboxes. The candidate's (prompt + completion)
only serves calls to the entry point over a pair of pipes, in a data-only encoding. The judge's
(prompt helpers + the benchmark's tests, code we trust) calls `check` on a proxy of the entry point and,
only after check returned, writes a per-run random token to a pipe that exists in no other process. The
test passes iff the host reads back exactly that token. Threat model (bubblewrap):
  - the candidate never holds the token, the verdict pipe, the tests or the expected values: they live in
    another pid, mount and user namespace, so /proc/self/fd, guessing descriptors, gc or frame inspection,
    ctypes, patching builtins / `check` / `assert` all act on a process that decides nothing;
  - exiting early (sys.exit, os._exit, posix._exit, SystemExit inside a call), crashing, hanging or
    writing garbage on its pipe makes the judge's call raise, and no token is written;
  - printing the token's format is output on the candidate's stdout, which the verdict never reads;
  - an object whose __eq__ always says True cannot cross the pipe: only exact builtin data types do;
  - killing the parent: the parent (bwrap's pid 1) belongs to another user; processes outside the
    namespace have no pid in it. Leftover processes (fork + setsid) die with the pid namespace, which is
    torn down when the launcher ends or the wall timeout kills bwrap.
  Not covered: a kernel exploit; the tests themselves are trusted (they come with the benchmark).
Whole programs (`run`, the author is the one judged) pass when the launcher reaches the end of them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import math
import os
import secrets
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

from d2f_jax.evals import sandbox_bwrap
from d2f_jax.evals.sandbox_bwrap import BubblewrapUnavailable

__all__ = ["Sandbox", "ExecResult", "TestProgram", "BubblewrapUnavailable", "bubblewrap_unavailable_reason",
           "ISOLATIONS"]

_LAUNCHER = Path(__file__).with_name("sandbox_launcher.py")
NOBODY = (65534, 65534)
ISOLATIONS = ("bubblewrap", "process")


class ProcessIsolationWarning(UserWarning):
  """isolation='process' was chosen: generated code is not contained."""


@dataclasses.dataclass(frozen=True)
class TestProgram:
  """A test to judge: `candidate` (prompt + completion) defines `entry_point`; `tests` defines check()."""

  __test__ = False  # not a pytest class

  candidate: str
  tests: str
  entry_point: str


@dataclasses.dataclass(frozen=True)
class ExecResult:
  """Outcome of one run: 'passed' (the verdict channel said so), 'failed' or 'timeout'."""

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
    code = self.returncode
    signum = -code if code is not None and code < 0 else (code - 128 if code is not None and code > 128 else 0)
    lines = [line for line in self.stderr.strip().splitlines() if line.strip()]
    if signum:
      try:
        name = signal.Signals(signum).name
      except ValueError:
        name = f"signal {signum}"
      hint = {"SIGXCPU": " (CPU time limit)", "SIGXFSZ": " (file size limit)"}.get(name, "")
      if not lines or code < 0:
        return f"killed by {name}{hint}"
    return lines[-1].strip() if lines else f"exit code {code} without a verdict"


def bubblewrap_unavailable_reason(python: str | None = None) -> str | None:
  """None when the bubblewrap sandbox works on this host, else the reason (for skips and error messages)."""
  try:
    return sandbox_bwrap.probe(sandbox_bwrap.base_interpreter(python))
  except BubblewrapUnavailable as e:
    return str(e)


@functools.lru_cache(maxsize=None)
def network_namespace_available() -> bool:
  """True when this process may create a network namespace with `unshare -n` (process isolation)."""
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
  """Limits and isolation for running generated code; `run_test` judges one test, `run_many` several.

  python: the interpreter (default: the one behind this process; under bubblewrap its base interpreter,
  so a venv's site-packages never enter the sandbox). drop_privileges / network_namespace / guards apply
  to isolation='process' only (None = use when available).
  """

  isolation: str = "bubblewrap"
  timeout_s: float = 10.0
  memory_mb: int = 1024
  file_mb: int = 16
  max_processes: int = 32
  max_open_files: int = 256
  tmpfs_mb: int = 64
  python: str | None = None
  output_chars: int = 4000
  drop_privileges: bool | None = None
  network_namespace: bool | None = None
  guards: bool = True
  _probe: bool = dataclasses.field(default=False, repr=False)

  def __post_init__(self):
    if self.isolation not in ISOLATIONS:
      raise ValueError(f"Sandbox.isolation must be one of {ISOLATIONS}, got {self.isolation!r}")
    if (isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or not self.timeout_s > 0
        or math.isinf(self.timeout_s)):
      raise ValueError(f"Sandbox.timeout_s must be a positive finite number of seconds, got {self.timeout_s!r}")
    for name in ("memory_mb", "file_mb", "max_processes", "max_open_files", "tmpfs_mb"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"Sandbox.{name} must be a positive int, got {value!r}")
    if self.python is not None and shutil.which(self.python) is None:
      raise ValueError(f"Sandbox.python {self.python!r} is not an executable interpreter")
    if self.isolation == "bubblewrap":
      self.python = sandbox_bwrap.base_interpreter(self.python)
      reason = None if self._probe else sandbox_bwrap.probe(self.python)
      if reason is not None:
        raise BubblewrapUnavailable(
            f"the bubblewrap sandbox does not work here: {reason}. Where namespaces are not permitted, pass "
            "isolation='process' (command line: --isolation process) to run generated code without them; "
            "that is no protection against hostile code.")
      return
    self.python = self.python or sys.executable
    warnings.warn("Sandbox(isolation='process'): generated code runs without namespaces; it can read files, "
                  "signal processes and outlive its timeout. Use it only where bubblewrap cannot run.",
                  ProcessIsolationWarning, stacklevel=3)
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

  def describe(self) -> dict:
    """Which isolation and limits this sandbox applies, for results.json."""
    limits = {"timeout_s": self.timeout_s, "cpu_s": self._cpu_seconds(), "memory_mb": self.memory_mb,
              "file_mb": self.file_mb, "open_files": self.max_open_files, "python": self.python,
              "verdict": "token written by a separate judge sandbox after check() returned"}
    if self.isolation == "bubblewrap":
      return {"isolation": "bubblewrap", "bwrap": sandbox_bwrap.bwrap_binary(), **limits,
              "max_processes": self.max_processes, "tmpfs_mb": self.tmpfs_mb, "uid": sandbox_bwrap.SANDBOX_UID,
              "namespaces": ["user", "pid", "mount", "network", "ipc", "uts", "cgroup"],
              "root": "read-only: interpreter, its shared libraries and standard library only"}
    return {"isolation": "process", **limits, "max_processes": self.max_processes if self.drop_privileges else None,
            "network_namespace": self.network_namespace, "run_as_nobody": self.drop_privileges,
            "python_guards": self.guards, "warning": "no protection against hostile code"}

  # ------------------------------------------------------------------------------------------ runs
  def run(self, source: str) -> ExecResult:
    """Run a whole program; 'passed' when it ran to its end without an exception."""
    return self._run({"program": {"mode": "program", "source": source}}, main="program")

  def run_test(self, test: TestProgram) -> ExecResult:
    """Judge one test: 'passed' only if the judge's token came back after check() returned."""
    return self._run({"judge": {"mode": "judge", "source": test.tests, "entry_point": test.entry_point},
                      "candidate": {"mode": "serve", "source": test.candidate, "entry_point": test.entry_point}},
                     main="judge")

  def run_many(self, jobs: list, workers: int = 1) -> list[ExecResult]:
    """Run programs (str) or tests (TestProgram) `workers` at a time; results in the order given."""
    one = lambda job: self.run_test(job) if isinstance(job, TestProgram) else self.run(job)  # noqa: E731
    if workers <= 1:
      return [one(j) for j in jobs]
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
      return list(pool.map(one, jobs))

  # ------------------------------------------------------------------------------------- internals
  def _cpu_seconds(self) -> int:
    return int(math.ceil(self.timeout_s)) + 1

  def _limits(self, untrusted: bool) -> dict:
    # Only binding for a user other than host root (the kernel exempts root), and counted per user: under
    # bubblewrap per fresh user namespace; in the fallback across every process `nobody` runs.
    binds = self.isolation == "bubblewrap" or (self.drop_privileges and untrusted)
    return {"RLIMIT_AS": self.memory_mb << 20, "RLIMIT_CPU": [self._cpu_seconds(), self._cpu_seconds() + 1],
            "RLIMIT_FSIZE": self.file_mb << 20, "RLIMIT_CORE": 0, "RLIMIT_NOFILE": self.max_open_files,
            "RLIMIT_NPROC": self.max_processes if binds else None}

  def _run(self, roles: dict, main: str) -> ExecResult:
    outer = tempfile.mkdtemp(prefix="d2f_sandbox_")
    procs, host_fds = {}, []
    try:
      os.chmod(outer, 0o711)
      token = secrets.token_hex(16)
      verdict_r, verdict_w = os.pipe()
      host_fds.append(verdict_r)
      child_fds = {name: [] for name in roles}
      if "candidate" in roles:
        request_r, request_w = os.pipe()
        reply_r, reply_w = os.pipe()
        roles["judge"].update(request_fd=request_w, reply_fd=reply_r, verdict_fd=verdict_w, token=token)
        roles["candidate"].update(request_fd=request_r, reply_fd=reply_w)
        child_fds["judge"] += [request_w, reply_r, verdict_w]
        child_fds["candidate"] += [request_r, reply_w]
      else:
        roles[main]["status_fd"] = verdict_w
        child_fds[main].append(verdict_w)
      start = time.perf_counter()
      try:
        for name in sorted(roles, key=lambda n: n != "candidate"):  # the server first
          procs[name] = self._spawn(outer, name, roles[name], tuple(child_fds[name]), untrusted=name != "judge")
      finally:
        for fds in child_fds.values():
          for fd in fds:
            os.close(fd)
      timed_out = not _wait(procs[main][0], max(0.0, self.timeout_s - (time.perf_counter() - start)))
      seconds = time.perf_counter() - start
      _kill_all(procs)
      os.set_blocking(verdict_r, False)
      try:
        said = os.read(verdict_r, 256)
      except BlockingIOError:
        said = b""
      expected = token.encode() if "candidate" in roles else b"done"
      returncode = procs[main][0].returncode
      status = "timeout" if timed_out else ("passed" if said == expected else "failed")
      order = [n for n in ("candidate", main) if n in procs]
      return ExecResult(status=status, returncode=returncode, seconds=seconds,
                        stdout="".join(_tail(procs[n][1], self.output_chars) for n in order)[-self.output_chars:],
                        stderr="".join(_tail(procs[n][2], self.output_chars) for n in order)[-self.output_chars:])
    finally:
      _kill_all(procs)
      for fd in host_fds:
        os.close(fd)
      shutil.rmtree(outer, ignore_errors=True)

  def _spawn(self, outer: str, name: str, job: dict, fds: tuple, untrusted: bool):
    home = os.path.join(outer, name)
    os.mkdir(home, 0o700)
    out_path, err_path = os.path.join(outer, f"{name}.out"), os.path.join(outer, f"{name}.err")
    job = dict(job, limits=self._limits(untrusted), uid=None, gid=None, guards=False)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
    extra_fds: tuple = ()
    if self.isolation == "bubblewrap":
      os.chmod(home, 0o755)
      root = os.geteuid() == 0
      job.update(workdir=sandbox_bwrap.WORKDIR)
      if root:
        job.update(uid=sandbox_bwrap.SANDBOX_UID, gid=sandbox_bwrap.SANDBOX_UID)
        info_r, info_w = os.pipe()
        block_r, block_w = os.pipe()
        extra_fds = (info_w, block_r)
      job_path = _write_job(home, job, 0o644)
      command = sandbox_bwrap.command(self.python, launcher=str(_LAUNCHER), job=job_path,
                                      tmpfs_bytes=self.tmpfs_mb << 20, map_ids_ourselves=root,
                                      block_fd=extra_fds[1] if root else None,
                                      info_fd=extra_fds[0] if root else None)
      cwd = home
    else:
      work = os.path.join(home, "work")
      os.mkdir(work, 0o700)
      job.update(workdir=work, guards=self.guards and untrusted)
      launcher = os.path.join(home, "launcher.py")
      shutil.copyfile(_LAUNCHER, launcher)
      job_path = _write_job(home, job, 0o600)
      if self.drop_privileges and untrusted:
        job.update(uid=NOBODY[0], gid=NOBODY[1])
        job_path = _write_job(home, job, 0o600)
        os.chmod(home, 0o711)
        for path in (work, launcher, job_path):
          os.chown(path, *NOBODY)
      command = [self.python, "-I", "-S", "-B", launcher, job_path]
      if self.network_namespace:
        command = [shutil.which("unshare"), "-n", "--"] + command
      env.update(HOME=work, TMPDIR=work)
      cwd = work
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
      try:
        proc = subprocess.Popen(command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                start_new_session=True, close_fds=True, pass_fds=fds + extra_fds)
      finally:
        for fd in extra_fds:
          os.close(fd)
    if extra_fds:
      try:
        sandbox_bwrap.write_id_maps(info_r, block_w)
      except (BubblewrapUnavailable, OSError) as e:
        _kill_group(proc)
        raise BubblewrapUnavailable(f"{e}; bwrap said: {_tail(err_path, 400).strip()}") from None
    return proc, out_path, err_path


def _wait(proc: subprocess.Popen, timeout: float) -> bool:
  """Wait up to `timeout` s for `proc`; True if it exited. A pidfd wakes at once (Popen.wait polls)."""
  try:
    fd = os.pidfd_open(proc.pid)
  except (AttributeError, OSError):
    try:
      proc.wait(timeout=timeout)
      return True
    except subprocess.TimeoutExpired:
      return False
  try:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    if not poller.poll(timeout * 1000):
      return False
  finally:
    os.close(fd)
  proc.wait()
  return True


def _write_job(home: str, job: dict, mode: int) -> str:
  path = os.path.join(home, "job.json")
  with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode), "w", encoding="utf-8") as f:
    json.dump(job, f)
  return path


def _kill_group(proc: subprocess.Popen) -> None:
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass
  proc.wait()


def _kill_all(procs: dict) -> None:
  for proc, _, _ in procs.values():
    _kill_group(proc)


def _tail(path: str, chars: int) -> str:
  with open(path, "rb") as f:
    f.seek(0, os.SEEK_END)
    size = f.tell()
    f.seek(max(0, size - 4 * chars))
    return f.read().decode("utf-8", errors="replace")[-chars:]
