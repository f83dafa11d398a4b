"""Child side of the sandbox: set OS limits, drop privileges if asked, install guards, run program.py.

Copied into the sandbox directory and run as `python -I -B launcher.py '<json options>'` with that
directory as the working directory. Standard library only. The guards catch the accidents generated
code makes (deleting files, writing elsewhere, opening sockets, spawning processes); Python code can
undo them (ctypes, gc introspection), so they are a second line behind the OS limits set by the parent.
"""

import builtins
import errno
import io
import json
import os
import sys
import traceback

_exit = os._exit  # kept before the guard replaces it: only the launcher may end the process this way
_realpath = os.path.realpath
_readlink = os.readlink


def _blocked(what, path=None):
  message = f"sandbox: {what} is blocked"
  if path is None:
    return PermissionError(errno.EPERM, message)
  return PermissionError(errno.EACCES, message, os.fsdecode(path) if isinstance(path, bytes) else str(path))


def _make_inside(root):
  def inside(path, dir_fd=None):
    if isinstance(path, int):  # an already-open descriptor
      return True
    path = os.fsdecode(os.fspath(path))
    if dir_fd is not None and not os.path.isabs(path):
      path = os.path.join(_readlink(f"/proc/self/fd/{dir_fd}"), path)
    real = _realpath(path)
    return real == root or real.startswith(root + os.sep)
  return inside


def _guard_paths(module, names, inside, arg_indices=(0,), dir_fd_keys=("dir_fd",)):
  for name in names:
    original = getattr(module, name, None)
    if original is None:
      continue

    def guarded(*args, _original=original, _name=name, **kwargs):
      for index, key in zip(arg_indices, dir_fd_keys):
        if index < len(args) and not inside(args[index], kwargs.get(key)):
          raise _blocked(f"{_name} outside the sandbox directory", args[index])
      return _original(*args, **kwargs)

    setattr(module, name, guarded)


def install_guards(root):
  inside = _make_inside(root)
  real_open = io.open

  def guarded_open(file, mode="r", *args, **kwargs):
    if any(c in mode for c in "wax+") and not inside(file):
      raise _blocked("opening a file for writing outside the sandbox directory", file)
    return real_open(file, mode, *args, **kwargs)

  builtins.open = io.open = guarded_open

  class GuardedFileIO(io.FileIO):
    def __init__(self, file, mode="r", *args, **kwargs):
      if any(c in mode for c in "wax+") and not inside(file):
        raise _blocked("opening a file for writing outside the sandbox directory", file)
      super().__init__(file, mode, *args, **kwargs)

  io.FileIO = GuardedFileIO

  real_os_open = os.open
  write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

  def guarded_os_open(path, flags, *args, dir_fd=None, **kwargs):
    if flags & write_flags and not inside(path, dir_fd):
      raise _blocked("os.open for writing outside the sandbox directory", path)
    return real_os_open(path, flags, *args, dir_fd=dir_fd, **kwargs)

  os.open = guarded_os_open
  _guard_paths(os, ("remove", "unlink", "rmdir", "removedirs", "mkdir", "makedirs", "chmod", "chown", "lchown",
                    "truncate", "utime", "mkfifo", "mknod", "setxattr", "removexattr", "chflags", "lchmod"), inside)
  _guard_paths(os, ("rename", "renames", "replace", "link"), inside, (0, 1), ("src_dir_fd", "dst_dir_fd"))
  _guard_paths(os, ("symlink",), inside, (1,), ("dir_fd",))
  import shutil
  _guard_paths(shutil, ("rmtree",), inside)

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


def set_limits(limits):
  """Soft = hard, so the program cannot raise them again (unless it is still root: see sandbox.py)."""
  import resource
  for name, value in limits.items():
    if value is not None:
      soft, hard = value if isinstance(value, list) else (value, value)
      resource.setrlimit(getattr(resource, name), (soft, hard))


def main():
  options = json.loads(sys.argv[1])
  set_limits(options["limits"])  # first, before anything the program controls
  root = _realpath(os.getcwd())
  if options.get("uid") is not None:  # root only: give up root once the limits are set
    os.setgroups([])
    os.setgid(options["gid"])
    os.setuid(options["uid"])
  with open(os.path.join(root, "program.py"), encoding="utf-8") as f:
    source = f.read()
  sys.argv = ["program.py"]
  if options.get("guards", True):
    install_guards(root)
  scope = {"__name__": "__main__", "__file__": os.path.join(root, "program.py"), "__builtins__": builtins}
  try:
    exec(compile(source, scope["__file__"], "exec"), scope)
  except BaseException:  # SystemExit too: a program that exits before its checks ran has not passed
    traceback.print_exc()
    _flush()
    _exit(1)
  _flush()
  _exit(0)


def _flush():
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except Exception:  # a program may have closed or replaced its streams
      pass


if __name__ == "__main__":
  main()
