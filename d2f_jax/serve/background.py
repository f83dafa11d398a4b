"""The engine's own thread (what the server runs): rounds while there is work, asleep on the engine's
condition otherwise, and the two ways it ends: a graceful shutdown (admit nothing, let work finish for a
grace, cancel the rest) and an abort (a server's second signal: cancel everything now). If a round raises,
the engine fails every request (finish_reason 'error') and keeps the failure for /health."""

from __future__ import annotations

import threading
import time


class EngineThread:
  """A small object the engine owns: it asks the engine for work and runs its rounds; the engine keeps the
  queue, the slots and the one way a request finishes."""

  def __init__(self, engine):
    self.engine = engine
    self._thread: threading.Thread | None = None
    self._stop_now = threading.Event()  # abort(): a shutdown stops waiting out its grace

  @property
  def started(self) -> bool:
    return self._thread is not None

  def start(self) -> None:
    if self._thread is None:
      self._thread = threading.Thread(target=self._serve, name="d2f-engine", daemon=True)
      self._thread.start()

  def join(self, timeout: float | None = None) -> None:
    if self._thread is not None:
      self._thread.join(timeout)

  def alive(self) -> bool:
    return self._thread is not None and self._thread.is_alive()

  def _serve(self) -> None:
    while self.engine.wait_for_work():
      try:
        self.engine.round()
      except Exception as e:  # noqa: BLE001 - a dead engine must end its requests, not leave them waiting
        self.engine.fail(f"{type(e).__name__}: {e}")
        return

  def abort(self) -> None:
    """End a shutdown's grace now (the engine cancels its requests)."""
    self._stop_now.set()

  def shutdown(self, grace_s: float) -> None:
    """Wait up to `grace_s` for the engine's work to finish (it admits nothing new), then have it cancel the
    rest and wait for the thread to deliver the cancellations."""
    deadline = time.monotonic() + grace_s
    while self.alive() and time.monotonic() < deadline and not self._stop_now.is_set():
      self.join(timeout=0.05)
    self.engine.cancel_all()
    self.join()
