"""What crosses the engine's boundary: a request's settings, the events it streams back, and the refusals.

Per-request settings are the decode knobs that are traced today (thresholds, temperature, top-p, stop ids)
plus `max_new_tokens` up to the engine's bound and `method`: on a D2F engine 'd2f' or 'threshold' (d2f with
tau_add 1 and one block in flight), on an AR engine (the causal baseline model) 'ar', on a LLaDA2 engine
'llada2' (the released block sampler; with the engine's editing on, LLaDA2.1's token editing, whose threshold
and post-fill steps a request may set). Block size, prompt bound and slot count are fixed per engine.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

ENGINE_METHODS = {"d2f": ("d2f", "threshold"), "ar": ("ar",), "llada2": ("llada2",)}  # engine -> request methods
FINISH_REASONS = ("stop", "length", "cancelled", "error")  # error: the engine thread failed


@dataclasses.dataclass(frozen=True)
class RequestSettings:
  """One request's decode settings; defaults are the paper's D2F thresholds, greedy."""

  method: str | None = None  # None: the engine's method
  max_new_tokens: int | None = None  # None: the engine's bound; else a multiple of its block size
  tau_add: float = 0.1
  tau_act: float = 0.95
  tau_conf: float = 0.9
  temperature: float = 0.0
  top_p: float = 1.0
  top_k: int = 0  # 0: off
  seed: int | None = None  # sampling: the request's draws are generate(..., key=jax.random.key(seed % 2**32))'s
  stop_ids: tuple[int, ...] | None = None  # None: the model's eos / end-of-turn ids
  editing_threshold: float | None = None  # llada2 engine with editing: None = the engine's (EngineConfig)
  max_post_steps: int | None = None  # llada2 engine with editing: None = the engine's


# The per-request d2f diagnostics the engine reads out of its loop state (decode.DecodeResult's fields).
STAT_KEYS = ("max_in_flight", "semi_steps", "max_accepted", "in_flight_sum", "window_sum", "position_sum")


class Completion(NamedTuple):
  """A finished request, field for field what `decode.generate` gives the same request alone."""

  tokens: list[int]  # up to and including the first stop id
  forwards: int
  trace: list[int]  # [max_new_tokens] step at which each position was accepted, -1 if never
  finish_reason: str  # 'stop', 'length' or 'cancelled'
  stats: dict  # STAT_KEYS: the d2f diagnostics of DecodeResult (zero for ar)
  query_limit: int | None = None  # the throughput mode it decoded in (EngineConfig.policy); None: exact D2F


class Event(NamedTuple):
  """What the engine tells a request's callback: new settled ids, and at the end why it finished."""

  request_id: str
  ids: list[int]  # ids settled since the last event, in order (a stop id is included, nothing after it)
  finished: bool
  finish_reason: str | None  # one of FINISH_REASONS when finished
  prompt_tokens: int
  completion_tokens: int  # settled so far
  forwards: int  # model forwards the request has taken so far
  completion: Completion | None = None  # with the last event


EventCallback = Callable[[Event], None]


class RequestError(ValueError):
  """A request the engine refuses before it queues: `field` names the offending setting (the server turns it
  into an HTTP 400 whose body names the field)."""

  def __init__(self, field: str, message: str):
    super().__init__(f"{field}: {message}")
    self.field = field
    self.message = message


class QueueFull(RuntimeError):
  """The waiting queue is at its bound (the server answers 429)."""


class EngineStopped(RuntimeError):
  """The engine is shutting down and admits nothing new (the server answers 503)."""
