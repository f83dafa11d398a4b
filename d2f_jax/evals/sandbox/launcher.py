"""Child side of the sandbox: set limits, drop to the sandbox user, then play one role. Standard library only.

Run as `python -I -S -B -X utf8 launcher.py JOB.json` (inside bubblewrap, or as a plain process in
the fallback). JOB holds the role and its inputs:
  - "program": run `source` as __main__; on reaching its end write b"done" to `status_fd`. Used for whole
    programs whose author is the one judged, so a pass is only "ran to its end without an exception".
  - "serve" (the candidate side of a test): run `source` (prompt + model completion), then answer calls
    to `entry_point` arriving on `request_fd` with results on `reply_fd`, values in a strict data-only
    encoding (wire.py). It never sees the tests, the expected values, the verdict channel or the token.
  - "judge" (trusted, in its own sandbox): run `source` (the benchmark's prompt helpers and tests), call
    `check(remote entry point)`, and only after it returned write the per-run token to `verdict_fd`.
Run by path, it loads SIBLINGS (standard-library-only files) from its own directory: -I keeps that directory
off sys.path and there is no d2f_jax package in the sandbox; the host binds or copies them beside it.
"""

import builtins
import json
import os
import sys
import traceback

_exit = os._exit  # kept before the process-mode guards replace it
SIBLINGS = ("wire", "guards")  # what it loads below; the host puts these files beside it


def _sibling(name):
  """Module `name` from the file beside this one, without touching sys.path or sys.modules."""
  import importlib.util
  spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(__file__), f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


if __package__:  # imported as d2f_jax.evals.sandbox.launcher (the host, tests)
  from d2f_jax.evals.sandbox import guards, wire
else:  # run by path
  wire, guards = _sibling("wire"), _sibling("guards")
encode, decode, send, receive = wire.encode, wire.decode, wire.send, wire.receive


# ---------------------------------------------------------------------------------------------- roles
def run_source(source, filename):
  scope = {"__name__": "__main__", "__file__": filename, "__builtins__": builtins}
  exec(compile(source, filename, "exec"), scope)
  return scope


def serve(job):
  """Candidate side: load the completion, then answer calls until the judge closes the channel."""
  request, reply = job["request_fd"], job["reply_fd"]
  try:
    function = run_source(job["source"], "candidate.py")[job["entry_point"]]
  except BaseException as e:  # a broken completion: tell the judge, which fails the test
    traceback.print_exc()
    send(reply, ["load_error", f"{type(e).__name__}: {e}"])
    return 1
  while True:
    message = receive(request)
    if message is None:
      return 0
    try:
      args = decode(message[0])
      kwargs = decode(message[1])
      result = ["ok", encode(function(*args, **kwargs))]
    except BaseException as e:  # SystemExit too: the call raised, the judge decides what that means
      result = ["raise", type(e).__name__, str(e)[:2000]]
    _flush()
    send(reply, result)


class CandidateError(Exception):
  """The candidate misbehaved on the channel (did not load, sent garbage, or went away)."""


class RemoteFunction:
  """What the judge's tests call: forwards each call to the candidate's sandbox and returns plain data."""

  def __init__(self, name, request_fd, reply_fd):
    self.__name__ = name
    self._request, self._reply = request_fd, reply_fd

  def __call__(self, *args, **kwargs):
    try:
      send(self._request, [encode(args), encode(kwargs)])
    except BrokenPipeError:  # it has gone; a load error it sent first is still readable
      pass
    try:
      message = receive(self._reply)
    except ValueError as e:
      raise CandidateError(f"unreadable reply from the candidate: {e}") from None
    if message is None:
      raise CandidateError("the candidate exited before answering")
    if not isinstance(message, list) or not message or not isinstance(message[0], str):
      raise CandidateError("malformed reply from the candidate")
    if message[0] == "ok" and len(message) == 2:
      try:
        return decode(message[1])
      except (ValueError, TypeError, OverflowError, RecursionError) as e:
        raise CandidateError(f"malformed value from the candidate: {e}") from None
    if message[0] == "raise" and len(message) == 3:
      cls = getattr(builtins, str(message[1]), None)
      if isinstance(cls, type) and issubclass(cls, Exception) and message[1] != "CandidateError":
        raise cls(f"(raised in the candidate) {message[2]}")
      raise CandidateError(f"the candidate raised {message[1]}: {message[2]}")
    if message[0] == "load_error" and len(message) == 2:
      raise CandidateError(f"the completion did not load: {message[1]}")
    raise CandidateError(f"unexpected reply {str(message[0])[:40]!r} from the candidate")


def judge(job):
  """Trusted side: the tests run here; the token is written only once check() has returned."""
  scope = run_source(job["source"], "tests.py")
  remote = RemoteFunction(job["entry_point"], job["request_fd"], job["reply_fd"])
  scope[job["entry_point"]] = remote  # tests may name it too (HumanEval/33 compares it with itself)
  scope["check"](remote)
  os.write(job["verdict_fd"], job["token"].encode())
  return 0


def program(job):
  run_source(job["source"], "program.py")
  _flush()
  os.write(job["status_fd"], b"done")
  return 0


# ------------------------------------------------------------------------------------ limits and uid
def set_limits(limits):
  """Soft = hard: a process without privileges cannot raise them again."""
  import resource
  for name, value in limits.items():
    if value is not None:
      resource.setrlimit(getattr(resource, name), (value, value) if isinstance(value, int) else tuple(value))


def drop_to(uid, gid):
  os.setgroups([])
  os.setgid(gid)
  os.setuid(uid)
  if os.getuid() != uid or os.geteuid() != uid:
    raise SystemExit("sandbox: could not drop privileges")


# ----------------------------------------------------------------------------------------------- main
def main():
  with open(sys.argv[1], encoding="utf-8") as f:
    job = json.load(f)
  set_limits(job["limits"])  # first, before anything the program controls
  if job.get("uid") is not None:
    drop_to(job["uid"], job["gid"])
  os.chdir(job["workdir"])
  sys.argv = [job["mode"]]
  if job.get("guards"):
    guards.install_guards(os.path.realpath(job["workdir"]))
  role = {"program": program, "serve": serve, "judge": judge}[job["mode"]]
  try:
    code = role(job)
  except BaseException:  # SystemExit too: a program that exits before its end has not passed
    traceback.print_exc()
    code = 1
  _flush()
  _exit(code)


def _flush():
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except Exception:  # a program may have closed or replaced its streams
      pass


if __name__ == "__main__":
  main()
