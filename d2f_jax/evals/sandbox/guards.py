"""Python-level guards for the process fallback (isolation='process'), installed by the launcher in each
untrusted role (a candidate, a whole program) before its code runs. Not a security boundary (bubblewrap is).
Standard library only: the launcher loads it from the file beside itself.
"""

import builtins
import errno
import io
import os

_realpath = os.path.realpath  # kept before the guards replace anything


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
