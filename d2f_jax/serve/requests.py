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


def request_knobs(settings: RequestSettings, *, model_config, engine_method: str, block_size: int, bound: int,
                  sampling: bool, query_limit: int | None = None) -> tuple[int, Knobs, frozenset]:
  """(max_new_tokens, knobs, stop ids) of a request: the knobs `generate` resolves for it alone (with the
  engine's query_limit, EngineConfig.query_limit)."""
  if not isinstance(settings, RequestSettings):
    raise TypeError(f"settings must be a RequestSettings, got {type(settings).__name__}")
  method = settings.method or engine_method
  if method not in ENGINE_METHODS[engine_method]:
    raise RequestError("method", f"this {engine_method} engine decodes {ENGINE_METHODS[engine_method]}, "
                                 f"got {settings.method!r}")
  n = bound if settings.max_new_tokens is None else settings.max_new_tokens
  if not isinstance(n, int) or isinstance(n, bool) or not 0 < n <= bound or n % block_size:
    raise RequestError("max_new_tokens", f"must be a positive multiple of the engine's block size {block_size} "
                                         f"up to its bound {bound}, got {n!r}")
  if settings.temperature and not sampling:
    raise RequestError("temperature", f"this engine decodes greedily (temperature 0); got {settings.temperature!r}: "
                                      "start it with sampling enabled to sample")
  if settings.seed is not None and (not isinstance(settings.seed, int) or isinstance(settings.seed, bool)):
    raise RequestError("seed", f"must be an integer, got {settings.seed!r}")
  try:
    config = DecodeConfig(method=method, block_size=block_size, max_new_tokens=n,
                          tau_add=settings.tau_add, tau_act=settings.tau_act, tau_conf=settings.tau_conf,
                          temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k,
                          stop_ids=None if settings.stop_ids is None else tuple(settings.stop_ids),
                          query_limit=query_limit)
    knobs = Knobs.on_host(config, model_config)
  except SettingError as e:
    raise RequestError(e.field, str(e)) from None
  except TypeError as e:  # a value of the wrong type met a comparison before its check
    raise RequestError("settings", str(e)) from None
  return n, knobs, frozenset(int(t) for t in knobs.stop_ids.tolist() if t >= 0)


def settled_ids(response: np.ndarray, n: int, mask_id: int, stop_ids: frozenset) -> list[int]:
  """The ids of a slot's response row that will not change: the prefix before the first mask, cut after
  the first stop id."""
  row = response[:n]
  masked = row == mask_id
  ids = row[:int(np.argmax(masked)) if masked.any() else n].tolist()
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
