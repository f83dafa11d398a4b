"""Launch and kill one sandbox run: the roles' processes, their pipes, the verdict token, the wall timeout.

`run` is the host side of the protocol that core.py's docstring describes: a test is a judge and a
candidate sandbox joined by a request and a reply pipe, and only the judge holds the verdict pipe and
the per-run token; a whole program gets the verdict pipe itself and says b"done" at its end. Each role
runs launcher.py (with the standard-library modules it loads, copied or bound beside it) on a
job file, under bwrap (bwrap.py) or as a plain process group, and is killed when the run ends.
"""

from __future__ import annotations

import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from d2f_jax.evals.sandbox import bwrap
from d2f_jax.evals.sandbox.bwrap import BubblewrapUnavailable
from d2f_jax.evals.sandbox.launcher import SIBLINGS
from d2f_jax.evals.sandbox.result import ExecResult

_LAUNCHER = Path(__file__).with_name("launcher.py")
_LAUNCHER_MODULES = tuple(Path(__file__).with_name(f"{name}.py") for name in SIBLINGS)
NOBODY = (65534, 65534)


def run(box, roles: dict, main: str) -> ExecResult:
  """Run `roles` (name -> job) under the isolation and limits of `box` (a sandbox.Sandbox); `main` is the
  role whose end is awaited."""
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
        procs[name] = spawn(box, outer, name, roles[name], tuple(child_fds[name]), untrusted=name != "judge")
    finally:
      for fds in child_fds.values():
        for fd in fds:
          os.close(fd)
    timed_out = not _wait(procs[main][0], max(0.0, box.timeout_s - (time.perf_counter() - start)))
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
                      stdout="".join(_tail(procs[n][1], box.output_chars) for n in order)[-box.output_chars:],
                      stderr="".join(_tail(procs[n][2], box.output_chars) for n in order)[-box.output_chars:])
  finally:
    _kill_all(procs)
    for fd in host_fds:
      os.close(fd)
    shutil.rmtree(outer, ignore_errors=True)


def spawn(box, outer: str, name: str, job: dict, fds: tuple, untrusted: bool):
  """Start one role's launcher in its own home under `outer`; (process, stdout path, stderr path)."""
  home = os.path.join(outer, name)
  os.mkdir(home, 0o700)
  out_path, err_path = os.path.join(outer, f"{name}.out"), os.path.join(outer, f"{name}.err")
  job = dict(job, limits=box.rlimits(untrusted), uid=None, gid=None, guards=False)
  env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
  extra_fds: tuple = ()
  if box.isolation == "bubblewrap":
    os.chmod(home, 0o755)
    root = os.geteuid() == 0
    job.update(workdir=bwrap.WORKDIR)
    if root:
      job.update(uid=bwrap.SANDBOX_UID, gid=bwrap.SANDBOX_UID)
      info_r, info_w = os.pipe()
      block_r, block_w = os.pipe()
      extra_fds = (info_w, block_r)
    job_path = _write_job(home, job, 0o644)
    command = bwrap.command(box.python, launcher=str(_LAUNCHER), job=job_path,
                                    modules=tuple(str(m) for m in _LAUNCHER_MODULES),
                                    tmpfs_bytes=box.tmpfs_mb << 20, map_ids_ourselves=root,
                                    block_fd=extra_fds[1] if root else None,
                                    info_fd=extra_fds[0] if root else None)
    cwd = home
  else:
    work = os.path.join(home, "work")
    os.mkdir(work, 0o700)
    job.update(workdir=work, guards=box.guards and untrusted)
    launcher = os.path.join(home, "launcher.py")
    shutil.copyfile(_LAUNCHER, launcher)
    modules = [os.path.join(home, module.name) for module in _LAUNCHER_MODULES]
    for module, copy in zip(_LAUNCHER_MODULES, modules):
      shutil.copyfile(module, copy)
    job_path = _write_job(home, job, 0o600)
    if box.drop_privileges and untrusted:
      job.update(uid=NOBODY[0], gid=NOBODY[1])
      job_path = _write_job(home, job, 0o600)
      os.chmod(home, 0o711)
      for path in (work, launcher, *modules, job_path):
        os.chown(path, *NOBODY)
    command = [box.python, "-I", "-S", "-B", launcher, job_path]
    if box.network_namespace:
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
      bwrap.write_id_maps(info_r, block_w)
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
