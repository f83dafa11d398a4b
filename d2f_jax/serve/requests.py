"""A request's settings checked against the engine and turned into its per-slot knobs; its streamed and
final tokens read from the slot's response row.

Checks name the offending field (RequestError), so the server's 400 body can too.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from d2f_jax.decode.config import DecodeConfig, Knobs, SettingError
from d2f_jax.serve.types import ENGINE_METHODS, STAT_KEYS, Completion, EventCallback, RequestError, RequestSettings


@dataclasses.dataclass
class Request:
  """One request's host-side record, from submit to its last event."""

  id: str
  prompt: np.ndarray  # [T] int32
  settings: RequestSettings
  max_new_tokens: int
  knobs: Knobs  # numpy scalars: what goes into the slot's row of the engine's knobs
  stop_ids: frozenset
  callback: EventCallback | None
  seed: int = 0  # its sampling key is jax.random.key(seed), as `generate(..., key=jax.random.key(seed))` alone
  slot: int | None = None
  query_limit: int | None = None  # the mode it was admitted in (EngineConfig.policy); None: exact D2F
  emitted: int = 0  # ids streamed so far
  cancelled: bool = False


def check_prompt(prompt_ids, *, vocab_size: int, max_prompt_len: int) -> np.ndarray:
  """The prompt as int32 ids: 1..max_prompt_len integers inside the vocabulary."""
  try:
    ids = np.asarray(prompt_ids)
  except (TypeError, ValueError) as e:
    raise RequestError("prompt", f"must be a list of token ids ({e})") from None
  if ids.ndim != 1 or not (np.issubdtype(ids.dtype, np.integer) and ids.dtype != np.bool_):
    raise RequestError("prompt", f"must be a flat list of integer token ids, got {str(prompt_ids)[:80]}")
  if ids.size == 0:
    raise RequestError("prompt", "is empty")
  if ids.size > max_prompt_len:
    raise RequestError("prompt", f"has {ids.size} tokens, more than this engine's max_prompt_len {max_prompt_len}")
  bad = ids[(ids < 0) | (ids >= vocab_size)]
  if bad.size:
    raise RequestError("prompt", f"token id {int(bad[0])} is outside the vocabulary [0, {vocab_size})")
  return ids.astype(np.int32)


def request_knobs(settings: RequestSettings, *, model_config, engine) -> tuple[int, Knobs, frozenset]:
  """(max_new_tokens, knobs, stop ids) of a request: the knobs `generate` resolves for it alone, on `engine`
  (an EngineConfig: its method, block size, bound, sampling, query_limit, steps and editing)."""
  if not isinstance(settings, RequestSettings):
    raise TypeError(f"settings must be a RequestSettings, got {type(settings).__name__}")
  method = settings.method or engine.method
  if method not in ENGINE_METHODS[engine.method]:
    raise RequestError("method", f"this {engine.method} engine decodes {ENGINE_METHODS[engine.method]}, "
                                 f"got {settings.method!r}")
  n, bound, block_size = settings.max_new_tokens, engine.max_new_tokens, engine.block_size
  n = bound if n is None else n
  if not isinstance(n, int) or isinstance(n, bool) or not 0 < n <= bound or n % block_size:
    raise RequestError("max_new_tokens", f"must be a positive multiple of the engine's block size {block_size} "
                                         f"up to its bound {bound}, got {n!r}")
  if settings.temperature and not engine.sampling:
    raise RequestError("temperature", f"this engine decodes greedily (temperature 0); got {settings.temperature!r}: "
                                      "start it with sampling enabled to sample")
  if settings.seed is not None and (not isinstance(settings.seed, int) or isinstance(settings.seed, bool)):
    raise RequestError("seed", f"must be an integer, got {settings.seed!r}")
  for name in ("editing_threshold", "max_post_steps"):
    if getattr(settings, name) is not None and engine.editing_threshold is None:
      raise RequestError(name, f"is a setting of LLaDA2.1's token editing, which this {engine.method} engine does "
                               "not run (a 'llada2' engine started with an editing threshold does)")
  editing = {} if engine.editing_threshold is None else dict(
      editing_threshold=_given(settings.editing_threshold, engine.editing_threshold),
      max_post_steps=_given(settings.max_post_steps, engine.max_post_steps))
  try:
    config = DecodeConfig(method=method, block_size=block_size, max_new_tokens=n,
                          tau_add=settings.tau_add, tau_act=settings.tau_act, tau_conf=settings.tau_conf,
                          temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k,
                          stop_ids=None if settings.stop_ids is None else tuple(settings.stop_ids),
                          query_limit=engine.query_limit, steps=engine.steps, **editing)
    knobs = Knobs.on_host(config, model_config)
  except SettingError as e:
    raise RequestError(e.field, str(e)) from None
  except TypeError as e:  # a value of the wrong type met a comparison before its check
    raise RequestError("settings", str(e)) from None
  return n, knobs, frozenset(int(t) for t in knobs.stop_ids.tolist() if t >= 0)


def _given(value, default):
  return default if value is None else value


def settled_ids(response: np.ndarray, n: int, mask_id: int, stop_ids: frozenset, final: int) -> list[int]:
  """The ids of a slot's response row that will not change: the prefix before the first mask, and before
  column `final` (the readout's: llada2 editing may still rewrite the current block), cut after the first
  stop id."""
  row = response[:max(min(n, int(final)), 0)]
  masked = row == mask_id
  ids = row[:int(np.argmax(masked)) if masked.any() else row.size].tolist()
  for i, tok in enumerate(ids):
    if tok in stop_ids:
      return ids[:i + 1]
  return ids


def completion(read: dict[str, Any], slot: int, n: int, stop_ids: frozenset, reason: str | None = None) -> Completion:
  """The finished request in `generate`'s terms: its response cut after the first stop id (masks left by the
  forward bound stay, as `generate` leaves them), its forwards and acceptance trace."""
  row = read["response"][slot, :n].tolist()
  cut = next((i + 1 for i, tok in enumerate(row) if tok in stop_ids), None)
  tokens = row if cut is None else row[:cut]
  stats = {k: int(read[k][slot]) for k in STAT_KEYS}
  return Completion(tokens=tokens, forwards=int(read["forwards"][slot]), trace=read["trace"][slot, :n].tolist(),
                    finish_reason=reason or ("stop" if cut is not None else "length"), stats=stats)
