"""The engine's own thread (what the server runs): rounds while there is work, sleeping on the engine's
condition otherwise; a graceful shutdown; and, if a round raises, every request ended with finish_reason
'error' instead of left waiting, the failure kept for /health."""

from __future__ import annotations

import collections
import threading
import time

from d2f_jax.serve.types import Completion, Event


class BackgroundLoop:
  """Mixed into Engine: uses its lock, queue, slots, round() and busy."""


  def start(self) -> None:
    if self._thread is None:
      self._thread = threading.Thread(target=self._serve, name="d2f-engine", daemon=True)
      self._thread.start()

  def _serve(self) -> None:
    while True:
      with self._lock:
        while not self.busy and not self._cancelled and self._admitting:
          self._lock.wait()
        if not self.busy and not self._admitting:
          return
      try:
        self.round()
      except Exception as e:  # noqa: BLE001 - a dead engine must end its requests, not leave them waiting
        self._fail(f"{type(e).__name__}: {e}")
        return

  def _fail(self, error: str) -> None:
    """End every queued and decoding request with finish_reason 'error' and admit nothing more."""
    with self._lock:
      self.error, self._admitting = error, False
      waiting, self.queue = list(self.queue), collections.deque()
    decoding = [r for r in self.slots if r is not None]
    self.slots = [None] * self.config.slots
    for request in waiting + decoding:
      if request.callback is not None:
        request.callback(Event(request.id, [], True, "error", int(request.prompt.size), request.emitted, 0,
                               Completion(tokens=[], forwards=0, trace=[], finish_reason="error", stats={})))

  def _cancel_all(self) -> None:
    """Mark every queued and decoding request cancelled (the next round ends them) and wake the thread; the
    caller holds the lock."""
    self._cancelled.update(r.id for r in self.queue)
    self._cancelled.update(r.id for r in self.slots if r is not None)
    self._lock.notify_all()

  def abort(self) -> None:
    """End every queued and decoding request at the engine's next round (finish_reason 'cancelled', the
    server's 'abort'), admit nothing more, and end a shutdown's grace now: a server's second signal."""
    with self._lock:
      self._admitting = False
      self._stop_now.set()
      self._cancel_all()

  def shutdown(self, grace_s: float = 30.0) -> None:
    """Admit nothing new; let queued and decoding requests finish for up to `grace_s`, then cancel the rest."""
    with self._lock:
      self._admitting = False
      self._lock.notify_all()
    deadline = time.monotonic() + grace_s
    while (self._thread is not None and self._thread.is_alive() and time.monotonic() < deadline
           and not self._stop_now.is_set()):
      self._thread.join(timeout=0.05)
    with self._lock:
      self._cancel_all()
    if self._thread is not None:
      self._thread.join()
    elif self.busy:
      self.round()  # no thread: deliver the cancellations here
