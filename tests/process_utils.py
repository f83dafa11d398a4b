"""Stopping a child process the way a scheduler does, in tests: SIGTERM once it is ready, then its status."""

import signal
from typing import Callable


def sigterm_when_ready(proc, ready: Callable[[], None], timeout: float) -> str:
  """Call `ready()` (it waits for, or asserts, the point at which to stop the child), send SIGTERM and wait
  up to `timeout` s; the child is killed if anything fails on the way. Returns the child's stderr."""
  try:
    ready()
    proc.send_signal(signal.SIGTERM)
    return proc.communicate(timeout=timeout)[1]
  finally:
    if proc.poll() is None:
      proc.kill()
