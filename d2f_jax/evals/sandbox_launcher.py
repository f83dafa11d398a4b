"""Child side of the sandbox: set limits, drop to the sandbox user, then play one role. Standard library only.

Run as `python -I -S -B -X utf8 sandbox_launcher.py JOB.json` (inside bubblewrap, or as a plain process in
the fallback). JOB holds the role and its inputs:
  - "program": run `source` as __main__; on reaching its end write b"done" to `status_fd`. Used for whole
    programs whose author is the one judged, so a pass is only "ran to its end without an exception".
  - "serve" (the candidate side of a test): run `source` (prompt + model completion), then answer calls
    to `entry_point` arriving on `request_fd` with results on `reply_fd`, values in a strict data-only
    encoding (below). It never sees the tests, the expected values, the verdict channel or the token.
  - "judge" (trusted, in its own sandbox): run `source` (the benchmark's prompt helpers and tests), call
    `check(remote entry point)`, and only after it returned write the per-run token to `verdict_fd`.
The wire format is JSON of tagged values: exact builtin types only (None, bool, int, float, complex, str,
bytes, list, tuple, set, frozenset, dict), so a candidate cannot hand the tests an object whose __eq__
always says True; anything else is an error on the candidate side, and anything malformed fails the judge.
"""

import builtins
import errno
import io
import json
import os
import sys
import traceback

_exit = os._exit  # kept before the process-mode guards replace it
_realpath = os.path.realpath
MAX_FRAME = 16 << 20  # bytes of one encoded call or reply
MAX_DEPTH = 200  # nesting of containers in one value


# ----------------------------------------------------------------------------------------------- wire
def encode(value, depth=0):
  """A tagged JSON-able form of `value`; TypeError for anything but exact builtin data types."""
  if depth > MAX_DEPTH:
    raise TypeError(f"value nested deeper than {MAX_DEPTH} levels (or self-referencing)")
  kind = type(value)
  if value is None:
    return ["n"]
  if kind is bool:
    return ["b", value]
  if kind is int:
    return ["i", hex(value)]  # hex: no 4300-digit conversion limit
  if kind is float:
    return ["f", value.hex()]  # exact, and keeps nan / inf / -0.0
  if kind is complex:
    return ["c", value.real.hex(), value.imag.hex()]
  if kind is str:
    return ["s", value]
  if kind is bytes:
    return ["y", value.hex()]
  tags = {list: "l", tuple: "t", set: "S", frozenset: "F"}
  if kind in tags:
    return [tags[kind], [encode(v, depth + 1) for v in value]]
  if kind is dict:
    return ["d", [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]]
  raise TypeError(f"a {kind.__module__}.{kind.__qualname__} cannot cross the sandbox boundary "
                  "(only builtin data types can)")


def decode(item, depth=0):
  """Inverse of `encode`; ValueError for anything it would not have produced."""
  if depth > MAX_DEPTH or not isinstance(item, list) or not item or not isinstance(item[0], str):
    raise ValueError("malformed value on the wire")
  tag, rest = item[0], item[1:]

  def one(kind):
    if len(rest) != 1 or not isinstance(rest[0], kind):
      raise ValueError(f"malformed {tag!r} value on the wire")
    return rest[0]

  if tag == "n" and not rest:
    return None
  if tag == "b":
    return one(bool)
  if tag == "i":
    return int(one(str), 16)
  if tag == "f":
    return float.fromhex(one(str))
  if tag == "c" and len(rest) == 2 and all(isinstance(r, str) for r in rest):
    return complex(float.fromhex(rest[0]), float.fromhex(rest[1]))
  if tag == "s":
    return one(str)
  if tag == "y":
    return bytes.fromhex(one(str))
  makers = {"l": list, "t": tuple, "S": set, "F": frozenset}
  if tag in makers:
    return makers[tag](decode(v, depth + 1) for v in one(list))
  if tag == "d":
    pairs = one(list)
    if not all(isinstance(p, list) and len(p) == 2 for p in pairs):
      raise ValueError("malformed dict on the wire")
    return {decode(k, depth + 1): decode(v, depth + 1) for k, v in pairs}
  raise ValueError(f"unknown tag {tag!r} on the wire")


def send(fd, message):
  data = json.dumps(message, ensure_ascii=True).encode()
  if len(data) > MAX_FRAME:
    raise ValueError(f"message of {len(data)} bytes exceeds the {MAX_FRAME}-byte limit")
  data = len(data).to_bytes(4, "big") + data
  while data:
    data = data[os.write(fd, data):]


def receive(fd):
  """One message, or None at end of stream; ValueError for an oversized or broken frame."""
  head = _read_exactly(fd, 4)
  if head is None:
    return None
  size = int.from_bytes(head, "big")
  if size > MAX_FRAME:
    raise ValueError(f"frame of {size} bytes exceeds the {MAX_FRAME}-byte limit")
  body = _read_exactly(fd, size)
  if body is None:
    raise ValueError("stream ended inside a frame")
  return json.loads(body)


def _read_exactly(fd, n):
  chunks, got = [], 0
  while got < n:
    chunk = os.read(fd, n - got)
    if not chunk:
      if got:
        raise ValueError("stream ended inside a frame")
      return None
    chunks.append(chunk)
    got += len(chunk)
  return b"".join(chunks)


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


# ------------------------------------------------------------ process-mode guards (not a boundary)
def _blocked(what, path=None):
  message = f"sandbox: {what} is blocked"
  if path is None:
    return PermissionError(errno.EPERM, message)
  return PermissionError(errno.EACCES, message, os.fsdecode(path) if isinstance(path, bytes) else str(path))


def install_guards(root):
  """Python-level guards for the process fallback: they catch the accidents generated code makes; ctypes
  or introspection undo them, so they are no security boundary (bubblewrap is)."""
  def inside(path, dir_fd=None):
    if isinstance(path, int):
      return True
    path = os.fsdecode(os.fspath(path))
    if dir_fd is not None and not os.path.isabs(path):
      path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
    real = _realpath(path)
    return real == root or real.startswith(root + os.sep)

  real_open = io.open

  def guarded_open(file, mode="r", *args, **kwargs):
    if any(c in mode for c in "wax+") and not inside(file):
      raise _blocked("opening a file for writing outside the sandbox directory", file)
    return real_open(file, mode, *args, **kwargs)

  builtins.open = io.open = guarded_open
  real_os_open = os.open
  write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

  def guarded_os_open(path, flags, *args, dir_fd=None, **kwargs):
    if flags & write_flags and not inside(path, dir_fd):
      raise _blocked("os.open for writing outside the sandbox directory", path)
    return real_os_open(path, flags, *args, dir_fd=dir_fd, **kwargs)

  os.open = guarded_os_open
  for names, index in ((("remove", "unlink", "rmdir", "removedirs", "mkdir", "makedirs", "chmod", "chown",
                         "lchown", "truncate", "utime", "mkfifo", "mknod"), (0,)),
                       (("rename", "renames", "replace", "link"), (0, 1)), (("symlink",), (1,))):
    for name in names:
      original = getattr(os, name, None)
      if original is None:
        continue

      def guarded(*args, _original=original, _name=name, _index=index, **kwargs):
        for i in _index:
          if i < len(args) and not inside(args[i], kwargs.get("dir_fd")):
            raise _blocked(f"{_name} outside the sandbox directory", args[i])
        return _original(*args, **kwargs)

      setattr(os, name, guarded)
  import shutil
  real_rmtree = shutil.rmtree

  def guarded_rmtree(path, *args, **kwargs):
    if not inside(path):
      raise _blocked("rmtree outside the sandbox directory", path)
    return real_rmtree(path, *args, **kwargs)

  shutil.rmtree = guarded_rmtree

  def no_processes(*args, **kwargs):
    raise _blocked("starting or signalling processes")

  for name in ("system", "popen", "fork", "forkpty", "execv", "execve", "execl", "execle", "execlp", "execlpe",
               "execvp", "execvpe", "spawnv", "spawnve", "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnvp",
               "spawnvpe", "posix_spawn", "posix_spawnp", "kill", "killpg", "setsid", "_exit"):
    if hasattr(os, name):
      setattr(os, name, no_processes)
  import subprocess
  subprocess.Popen = no_processes
  import resource
  resource.setrlimit = resource.prlimit = no_processes
  import _socket
  import socket

  def no_network(*args, **kwargs):
    raise _blocked("network access")

  for module in (socket, _socket):
    for name in ("socket", "socketpair", "fromfd", "create_connection", "create_server", "getaddrinfo"):
      if hasattr(module, name):
        setattr(module, name, no_network)


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
    install_guards(_realpath(job["workdir"]))
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
