"""Run untrusted generated code and decide pass/fail where that code cannot reach: HumanEval's sandbox.

Isolation (`Sandbox(isolation=...)`, recorded in results.json through `describe()`):
  - "bubblewrap" (default): every process in fresh user/pid/mount/network/ipc/uts namespaces with a
    read-only minimal root, a private size-capped tmpfs, user 65534 and rlimits (bwrap.py). If
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

This module: the options, their checks, describe() and the bubblewrap probe. The runs' processes, pipes
and token are execute.py's; TestProgram and ExecResult are result.py's; the child side is launcher.py
(all in this package, d2f_jax/evals/sandbox/).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
import os
import shutil
import stat
import subprocess
import sys
import warnings
from pathlib import Path

from d2f_jax.evals.sandbox import bwrap, execute
from d2f_jax.evals.sandbox.bwrap import BubblewrapUnavailable
from d2f_jax.evals.sandbox.result import ExecResult, TestProgram

__all__ = ["Sandbox", "ExecResult", "TestProgram", "BubblewrapUnavailable", "bubblewrap_unavailable_reason",
           "ISOLATIONS"]

ISOLATIONS = ("bubblewrap", "process")


class ProcessIsolationWarning(UserWarning):
  """isolation='process' was chosen: generated code is not contained."""


def bubblewrap_unavailable_reason(python: str | None = None) -> str | None:
  """None when the bubblewrap sandbox works on this host, else the reason (for skips and error messages)."""
  try:
    return _bubblewrap_reason(bwrap.base_interpreter(python))
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
      self.python = bwrap.base_interpreter(self.python)
      reason = None if self._probe else _bubblewrap_reason(self.python)
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
      return {"isolation": "bubblewrap", "bwrap": bwrap.bwrap_binary(), **limits,
              "max_processes": self.max_processes, "tmpfs_mb": self.tmpfs_mb, "uid": bwrap.SANDBOX_UID,
              "namespaces": ["user", "pid", "mount", "network", "ipc", "uts", "cgroup"],
              "root": "read-only: interpreter, its shared libraries and standard library only"}
    return {"isolation": "process", **limits, "max_processes": self.max_processes if self.drop_privileges else None,
            "network_namespace": self.network_namespace, "run_as_nobody": self.drop_privileges,
            "python_guards": self.guards, "warning": "no protection against hostile code"}

  # ------------------------------------------------------------------------------------------ runs
  def run(self, source: str) -> ExecResult:
    """Run a whole program; 'passed' when it ran to its end without an exception."""
    return execute.run(self, {"program": {"mode": "program", "source": source}}, main="program")

  def run_test(self, test: TestProgram) -> ExecResult:
    """Judge one test: 'passed' only if the judge's token came back after check() returned."""
    roles = {"judge": {"mode": "judge", "source": test.tests, "entry_point": test.entry_point},
             "candidate": {"mode": "serve", "source": test.candidate, "entry_point": test.entry_point}}
    return execute.run(self, roles, main="judge")

  def run_many(self, jobs: list, workers: int = 1) -> list[ExecResult]:
    """Run programs (str) or tests (TestProgram) `workers` at a time; results in the order given."""
    one = lambda job: self.run_test(job) if isinstance(job, TestProgram) else self.run(job)  # noqa: E731
    if workers <= 1:
      return [one(j) for j in jobs]
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
      return list(pool.map(one, jobs))

  # ---------------------------------------------------------------------------------------- limits
  def _cpu_seconds(self) -> int:
    return int(math.ceil(self.timeout_s)) + 1

  def rlimits(self, untrusted: bool) -> dict:
    """The launcher's resource limits for one role (`untrusted`: the candidate's or a whole program's)."""
    # Only binding for a user other than host root (the kernel exempts root), and counted per user: under
    # bubblewrap per fresh user namespace; in the fallback across every process `nobody` runs.
    binds = self.isolation == "bubblewrap" or (self.drop_privileges and untrusted)
    return {"RLIMIT_AS": self.memory_mb << 20, "RLIMIT_CPU": [self._cpu_seconds(), self._cpu_seconds() + 1],
            "RLIMIT_FSIZE": self.file_mb << 20, "RLIMIT_CORE": 0, "RLIMIT_NOFILE": self.max_open_files,
            "RLIMIT_NPROC": self.max_processes if binds else None}


# ------------------------------------------------------------------------------------------ probe
def _bubblewrap_reason(python: str) -> str | None:
  """None when a bubblewrap sandbox works here for `python`, else why not: bwrap's own checks
  (bwrap.probe), then a trivial program through the real code path."""
  return bwrap.probe(python) or _trial_run(python)


@functools.lru_cache(maxsize=None)
def _trial_run(python: str) -> str | None:
  try:
    result = Sandbox(isolation="bubblewrap", timeout_s=20.0, python=python, _probe=True).run("pass\n")
  except BubblewrapUnavailable as e:
    return str(e)
  if result.passed:
    return None
  return f"a trivial program did not run under bwrap: {result.stderr.strip()[-300:] or result.reason}"
