"""Run untrusted generated code and decide pass/fail where that code cannot reach: HumanEval's sandbox.

The package's public face; callers import from here. Its modules (the threat model is core.py's docstring):
  core.py      Sandbox: the options, their checks, describe() and the bubblewrap probe
  execute.py   the host side of one run: the roles' processes, their pipes, the verdict token, the timeout
  bwrap.py     bubblewrap: where bwrap is, the minimal root, the command line, the uid/gid maps
  result.py    TestProgram (what a test run is given) and ExecResult (what a run returns)
  launcher.py  the child side, run by path inside the sandbox (standard library only), with the two
  wire.py      modules it loads from beside itself: the data-only encoding on the pipes, and the
  guards.py    Python-level guards of the process fallback
"""

from __future__ import annotations

from d2f_jax.evals.sandbox.bwrap import BubblewrapUnavailable
from d2f_jax.evals.sandbox.core import (ISOLATIONS, ProcessIsolationWarning, Sandbox, bubblewrap_unavailable_reason,
                                        network_namespace_available, world_executable)
from d2f_jax.evals.sandbox.result import ExecResult, TestProgram

__all__ = ["Sandbox", "ExecResult", "TestProgram", "BubblewrapUnavailable", "bubblewrap_unavailable_reason",
           "ISOLATIONS", "ProcessIsolationWarning", "network_namespace_available", "world_executable"]
