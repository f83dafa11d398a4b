"""What a sandbox run is given and what it returns: a TestProgram to judge, the ExecResult of a run."""

from __future__ import annotations

import dataclasses
import signal


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
