"""The continuous-batching D2F engine: S fixed slots over one model, refilled from a queue as requests finish.

JetStream's shape (prefill / insert / generate over fixed slots) on the D2F loop state: a round admits
queued requests into free slots (`programs.insert`: their prefill and first step, several of one prompt
bucket in one call), advances every live slot up to `steps_per_call` D2F steps in one device call that
returns as soon as a slot finishes, then reads the slots' responses (a few KB) and streams each request's
newly settled ids to its callback.
Shapes never change after warm-up: one advance program, one insert program per prompt bucket and admission
count (1, 2, 4, ... up to max_insert).

Greedy decoding is batch-invariant: a request's tokens, forwards and acceptance steps are those of
`decode.generate` on it alone, whatever shares the engine and whenever it arrived (tests/test_serve_engine.py).

Thread model: `submit` / `cancel` may be called from any thread; device work runs on the engine's own thread
(`start`), or on the caller's (`run_until_idle`, `complete`).
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from typing import Sequence

import jax
import numpy as np

from d2f_jax import xla_maps
from d2f_jax.decode import limits
from d2f_jax.decode.config import resolve
from d2f_jax.decode.methods import check_method_fits, model_attention
from d2f_jax.serve.background import EngineThread
from d2f_jax.serve.config import EngineConfig, split_admissions
from d2f_jax.serve.programs import Admission, SlotPrograms
from d2f_jax.serve.requests import Request, check_prompt, completion, request_knobs, settled_ids
from d2f_jax.serve.types import Completion, EngineStopped, Event, EventCallback, QueueFull, RequestSettings


class Engine:
  """Slots, a queue and the loop that keeps the slots full. `model`: a d2f_jax.Model (optionally `shard`ed)."""

  def __init__(self, model, config: EngineConfig = EngineConfig()):
    limits.check_positions(model.config, config.prompt_width, config.max_new_tokens)
    self.model, self.config = model, config
    base = config.decode_config()
    check_method_fits(model.config, base, model_attention(model))
    self.spec, knobs = resolve(base, model.config)
    placement = getattr(model, "placement", None)
    devices = list(placement.mesh.devices.flat) if placement is not None else jax.local_devices()[:1]
    layout = None if placement is None else placement.layout
    self.programs = SlotPrograms(model.graphdef, self.spec, layout, config.steps_per_call)
    cache = jax.eval_shape(lambda: self.programs.empty(config.slots, config.prompt_width, knobs)).state.cache
    limits.check_memory(model.config, config.slots, 0 if cache is None else cache.max_len, model.state, devices,
                        config.memory_budget_gib)  # the slots' KV cache as allocated (none: llada2's own loop)
    self.batch = self.programs.empty(config.slots, config.prompt_width, knobs)  # the slots on the device
    self.slots: list[Request | None] = [None] * config.slots
    self.queue: collections.deque[Request] = collections.deque()
    self.advance_calls = 0  # device calls of `advance` (for the bench)
    self.insert_calls = 0  # device calls of `insert`
    self._ids = itertools.count()
    self._lock = threading.Condition()
    self._cancelled: set[str] = set()
    self._admitting = True
    self.error: str | None = None  # why the engine thread died, if it did (every request then ended 'error')
    self.thread = EngineThread(self)
    self._seeds = np.random.default_rng(0)  # a request without a seed gets the next draw: runs repeat

  # --- requests -------------------------------------------------------------------------------------------

  def submit(self, prompt_ids: Sequence[int], settings: RequestSettings = RequestSettings(),
             callback: EventCallback | None = None, request_id: str | None = None) -> str:
    """Queue a request (checked first: RequestError names the field); returns its id."""
    prompt = check_prompt(prompt_ids, vocab_size=self.model.config.vocab_size,
                          max_prompt_len=self.config.max_prompt_len)
    n, knobs, stop_ids = self._request_knobs(settings)
    with self._lock:
      if self.error is not None:
        raise EngineStopped(f"the engine failed and admits no requests: {self.error}")
      if not self._admitting:
        raise EngineStopped("the engine is shutting down and admits no new requests")
      if len(self.queue) >= self.config.queue_size:
        raise QueueFull(f"{len(self.queue)} requests are waiting (queue_size {self.config.queue_size})")
      seed = settings.seed if settings.seed is not None else int(self._seeds.integers(2 ** 32))
      request = Request(id=request_id or f"req-{next(self._ids)}", prompt=prompt, settings=settings,
                        max_new_tokens=n, knobs=knobs, stop_ids=stop_ids, callback=callback, seed=seed % 2 ** 32)
      self.queue.append(request)
      self._lock.notify_all()
    return request.id

  def _request_knobs(self, settings: RequestSettings):
    return request_knobs(settings, model_config=self.model.config, engine=self.config)

  def cancel(self, request_id: str) -> None:
    """Stop a request (queued or decoding): its slot frees at the next round; its callback gets a last
    event with finish_reason 'cancelled'."""
    with self._lock:
      self._cancelled.add(request_id)
      self._lock.notify_all()

  @property
  def busy(self) -> bool:
    return bool(self.queue) or any(r is not None for r in self.slots)

  def load(self) -> dict:
    """A consistent snapshot for health checks: slots, free slots, queued requests, and the failure if any."""
    with self._lock:
      busy = sum(r is not None for r in self.slots)
      return {"slots": self.config.slots, "free_slots": self.config.slots - busy, "queued": len(self.queue),
              "admitting": self._admitting and self.error is None, "error": self.error}

  def warm_up(self) -> float:
    """Compile every program serving runs (an insert per prompt bucket and admission count, advance, release,
    readout) on the first slots, then free them; seconds taken. Call before serving so no request pays a compile."""
    if self.busy:
      raise RuntimeError("warm_up() needs an idle engine")
    xla_maps.ensure_headroom(force=True)  # before this engine's programs, never while it serves
    start = time.perf_counter()
    _, knobs, _ = self._request_knobs(RequestSettings())
    for width in self.config.prompt_buckets:
      for size in self.config.insert_sizes:
        prompts = np.full((size, width), self.model.config.pad_token_id, np.int32)
        self._insert(list(range(size)), prompts, np.ones((size,), np.int32), [knobs] * size, [0] * size)
        self.batch = self.programs.release(self.batch, np.arange(size, dtype=np.int32))
    self.batch = self.programs.advance(self.model.state, self.batch)
    jax.block_until_ready(self.programs.readout(self.batch))
    return time.perf_counter() - start

  # --- the engine's thread (serve/background.py) ----------------------------------------------------------
  def start(self) -> None:  # rounds on the engine's own thread from now on (what the server does)
    self.thread.start()

  def wait_for_work(self) -> bool:
    """Block until there is work; False once the engine admits nothing and has nothing left (the thread ends)."""
    with self._lock:
      while not self.busy and not self._cancelled and self._admitting:
        self._lock.wait()
      return self.busy or self._admitting

  def fail(self, error: str) -> None:
    """End every queued and decoding request with finish_reason 'error' and admit nothing more."""
    with self._lock:
      self.error, self._admitting = error, False
      waiting, self.queue = list(self.queue), collections.deque()
    decoding = [r for r in self.slots if r is not None]
    self.slots = [None] * self.config.slots
    for request in waiting + decoding:
      self._finish(request, "error")

  def cancel_all(self) -> None:
    """Mark every queued and decoding request cancelled (the next round ends them) and wake the thread."""
    with self._lock:
      self._cancelled.update(r.id for r in self.queue)
      self._cancelled.update(r.id for r in self.slots if r is not None)
      self._lock.notify_all()

  def abort(self) -> None:
    """End every queued and decoding request at the next round (finish_reason 'cancelled', the server's
    'abort'), admit nothing more, and end a shutdown's grace now: a server's second signal."""
    with self._lock:
      self._admitting = False
    self.thread.abort()
    self.cancel_all()

  def shutdown(self, grace_s: float = 30.0) -> None:
    """Admit nothing new; let queued and decoding requests finish for up to `grace_s`, then cancel the rest."""
    with self._lock:
      self._admitting = False
      self._lock.notify_all()
    if self.thread.started:
      self.thread.shutdown(grace_s)
    else:
      self.cancel_all()
      self.run_until_idle()  # no thread: deliver the cancellations here

  # --- the loop -------------------------------------------------------------------------------------------

  def round(self) -> bool:
    """One round: cancellations, admissions, one advance call, events. Returns whether work remains.

    The inserts and the advance are queued back to back and the host reads the slots once, after both: a
    request its first step already finished (frozen, the advance leaves it) is reported then."""
    with self._lock:
      cancelled, self._cancelled = self._cancelled, set()
      kept = [r for r in self.queue if r.id not in cancelled]
      dropped = [r for r in self.queue if r.id in cancelled]
      self.queue = collections.deque(kept)
    for request in dropped:
      self._finish(request, "cancelled")
    for slot, request in enumerate(self.slots):
      if request is not None and request.id in cancelled:
        self.batch = self.programs.release(self.batch, np.int32(slot))
        self.slots[slot] = None
        self._finish(request, "cancelled")
    self._admit()
    if any(r is not None for r in self.slots):
      self.batch = self.programs.advance(self.model.state, self.batch)
      self.advance_calls += 1
      self._publish()
    return self.busy

  def _admit(self) -> None:
    """Fill free slots from the queue: the admitted requests grouped by prompt bucket, each group prefilled
    in as few insert calls as the compiled admission counts allow."""
    free = [slot for slot, request in enumerate(self.slots) if request is None]
    with self._lock:
      admitted = [self.queue.popleft() for _ in range(min(len(free), len(self.queue)))]
    if not admitted:
      return
    live = sum(r is not None for r in self.slots) + len(admitted)
    by_bucket: dict[int, list[Request]] = collections.defaultdict(list)
    for request in admitted:
      self._choose_mode(request, live)
      by_bucket[self.config.bucket(request.prompt.size)].append(request)
    free_slots = iter(free)
    for width, group in sorted(by_bucket.items()):
      for size in split_admissions(len(group), self.config.insert_sizes):
        chunk, group = group[:size], group[size:]
        prompts = np.full((size, width), self.model.config.pad_token_id, np.int32)
        for row, request in enumerate(chunk):
          prompts[row, width - request.prompt.size:] = request.prompt
        slots = [next(free_slots) for _ in chunk]
        self._insert(slots, prompts, np.asarray([r.prompt.size for r in chunk], np.int32), [r.knobs for r in chunk],
                     [r.seed for r in chunk])
        for slot, request in zip(slots, chunk):
          request.slot, self.slots[slot] = slot, request

  def _choose_mode(self, request: Request, live_slots: int) -> None:
    """The request's mode by the engine's policy for the live slot count, kept to its end: its answer is then
    its batch-1 decode in that mode. A knob of the compiled programs, so switching never recompiles."""
    if not self.spec.query_mode:
      return
    request.query_limit = self.config.query_limit_at(live_slots)
    limit = self.config.block_size if request.query_limit is None else request.query_limit
    request.knobs = request.knobs.replace(
        query_limit=np.asarray(limit, np.int32),
        cache_decided=np.asarray(self.config.cache_decided and request.query_limit is not None))

  def _insert(self, slots: list[int], prompts: np.ndarray, prompt_lens: np.ndarray, knobs: list,
              seeds: list[int]) -> None:
    self.insert_calls += 1
    row_knobs = jax.tree.map(lambda *rows: np.stack([np.asarray(r) for r in rows]), *knobs)
    admission = Admission(slots=np.asarray(slots, np.int32), prompt=prompts, prompt_len=prompt_lens,
                          knobs=row_knobs, seeds=np.asarray(seeds, np.uint32))
    self.batch = self.programs.insert(self.model.state, self.batch, admission)

  def _publish(self) -> None:
    """Read the slots once; stream settled ids; finish and free the slots that are done."""
    read = jax.tree.map(np.asarray, jax.device_get(self.programs.readout(self.batch)))
    mask_id = self.model.config.mask_token_id
    for slot, request in enumerate(self.slots):
      if request is None:
        continue
      if read["done"][slot]:
        final = completion(read, slot, request.max_new_tokens, request.stop_ids)._replace(
            query_limit=request.query_limit)
        self.slots[slot] = None
        self._finish(request, final.finish_reason, final.tokens[request.emitted:], final)
      else:
        ids = settled_ids(read["response"][slot], request.max_new_tokens, mask_id, request.stop_ids,
                          read["final"][slot])
        if len(ids) > request.emitted:
          self._emit(request, ids[request.emitted:], forwards=int(read["forwards"][slot]))

  def _emit(self, request: Request, ids: list[int], *, forwards: int, final: Completion | None = None) -> None:
    """Stream newly settled ids to the request's callback (the last event carries its completion)."""
    request.emitted += len(ids)
    if request.callback is not None:
      request.callback(Event(request.id, list(ids), final is not None, None if final is None else final.finish_reason,
                             int(request.prompt.size), request.emitted, forwards, final))

  def _finish(self, request: Request, reason: str, ids: Sequence[int] = (), final: Completion | None = None) -> None:
    """The one way a request ends: its last ids and its completion (empty for 'cancelled' and 'error')."""
    if final is None:
      final = Completion(tokens=[], forwards=0, trace=[], finish_reason=reason, stats={})
    self._emit(request, list(ids), forwards=final.forwards, final=final)

  def run_until_idle(self) -> None:
    """Rounds on the calling thread until no request is queued or decoding."""
    while self.round():
      pass

  def complete(self, prompts: Sequence[Sequence[int]], settings: RequestSettings | Sequence[RequestSettings]
               = RequestSettings(), *, progress=None) -> list[Completion]:
    """Every prompt through the engine (on this thread), results in prompt order. `progress`: a callable
    taking the number of requests just finished (e.g. a tqdm bar's update)."""
    many = settings if isinstance(settings, (list, tuple)) else [settings] * len(prompts)
    done: dict[int, Completion] = {}

    def on_event(index):
      def callback(event: Event):
        if event.finished:
          done[index] = event.completion
          if progress is not None:
            progress(1)
      return callback
    for i, (prompt, s) in enumerate(zip(prompts, many)):
      self.submit(prompt, s, on_event(i))
    self.run_until_idle()
    return [done[i] for i in range(len(prompts))]
