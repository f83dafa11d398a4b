"""Query-limited windows (DecodeConfig.query_limit = q): the d2f forward of a throughput mode.

The exact step feeds every column of the window: finished blocks awaiting their cache write, and each block
in flight whole, masks included. Here a block in flight feeds its decided positions (the context its masks
are decided from: they are not cached yet) and only its first q still-masked positions, the ones this
step may accept; its later masks are left out of the forward, neither computed nor attended by anyone
(Fast-dLLM v2 decodes a block in sub-blocks the same way). Finished blocks are fed whole, as their K/V is
written. For a model with shifted logits (Dream: position p is predicted from the output at p - 1), the
position before each fed mask is fed too.

The fed columns are gathered to the front of the window in column order (attention is by block id, so
order within the window does not matter, and the finished blocks stay first for the cache write); the
forward runs at the narrowest compiled width in positions (`spec.query_widths`) holding every live row's
fed columns, and the choices are scattered back to the window's columns for the shared bookkeeping.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from d2f_jax.decode.config import DecodeSpec, per_row
from d2f_jax.decode.sampling import choose_tokens
from d2f_jax.decode.widths import narrowest
from d2f_jax.models import PAD_ID

DROPPED = jnp.iinfo(jnp.int32).max  # a cache slot past any cache: not written (KVCache.put / hide)


def fed_columns(tokens: jax.Array, cached: jax.Array, added: jax.Array, query_limit: jax.Array, spec: DecodeSpec,
                kept: jax.Array | None = None, pending: jax.Array | None = None):
  """(fed, candidate) [B, W] bool over the widest window's columns: what the forward computes, and the
  masked positions it may accept (each block's first q masks). tokens: [B, W] the window's ids; cached /
  added: [B] blocks in the cache / appended (the window starts at the first uncached block); query_limit:
  q, a scalar or one per row [B] (Knobs.query_limit). cache_decided: `kept` [B, W] the columns whose K/V
  the cache keeps (`kept_columns`) are not fed, except in the `pending` [B] finished blocks written now."""
  batch = tokens.shape[0]
  nk, bs = spec.window_blocks, spec.block_size
  slot = jnp.arange(nk, dtype=jnp.int32)[None, :]  # [1, nk]
  exists = (cached[:, None] + slot < added[:, None])[..., None]  # [B, nk, 1]
  masked = (tokens == spec.model.mask_token_id).reshape(batch, nk, bs) & exists  # [B, nk, bs]
  rank = jnp.cumsum(masked, axis=-1) - 1  # [B, nk, bs] order of each mask in its block
  candidate = (masked & (rank < per_row(query_limit, 3))).reshape(batch, -1)  # [B, W]
  decided = exists & ~masked  # [B, nk, bs] decided positions (finished blocks: all)
  if kept is not None:
    whole = (slot < pending[:, None])[..., None]  # [B, nk, 1] written now: fed whole, exactly
    decided = decided & (whole | ~kept.reshape(batch, nk, bs))
  fed = decided.reshape(batch, -1) | candidate
  if spec.model.logit_shift:  # the output at p - 1 predicts p (column 0's is the cache's last row)
    fed = fed | jnp.pad(candidate[:, 1:], ((0, 0), (0, 1)))
  return fed, candidate


def window_slots(cache_length: jax.Array, spec: DecodeSpec) -> jax.Array:
  """[B, W] the cache slot of each window column: the window starts at the first block not appended to the
  cache, so its column i is written at slot length + i (whatever the row's padding: the engine lays a row's
  token buffer out wider than its cache)."""
  return cache_length[:, None] + jnp.arange(spec.window, dtype=jnp.int32)[None, :]


def kept_columns(cache_ids: jax.Array, slots: jax.Array) -> jax.Array:
  """[B, W] bool: window columns whose cache slot (`window_slots`) holds K/V (cache_ids [B, S]), i.e. K/V kept
  for decided positions in flight (KVCache.put): the window lies past the appended prefix."""
  size = cache_ids.shape[1]
  return (slots < size) & (jnp.take_along_axis(cache_ids, jnp.minimum(slots, size - 1), axis=1) != PAD_ID)


def kept_slots(packed: "Packed", slots: jax.Array, order: jax.Array, spec: DecodeSpec) -> jax.Array:
  """[B, W] cache slot of each packed column whose K/V the cache keeps after the forward: the decided ones
  fed; DROPPED elsewhere. slots: [B, W] the window's (`window_slots`)."""
  keep = (packed.ids != PAD_ID) & (packed.tokens != spec.model.mask_token_id)
  return jnp.where(keep, gather(slots, order), DROPPED)


def within_budget(tokens, cached, added, live, query_limit, spec: DecodeSpec, kept=None, pending=None) -> jax.Array:
  """Each row's q for this step under `spec.position_budget`: its own (`query_limit`, scalar or [B]), or the
  largest of block size, half of it, ... 1 at which the live rows' fed positions sum to the budget or less
  (1 when none does). The same rule for every row, so a batch narrows together."""
  if spec.position_budget is None:
    return query_limit
  bs = spec.block_size
  chosen = jnp.int32(1)
  for rung in reversed([bs >> k for k in range(bs.bit_length() - 1)]):  # ascending above 1: the last fit wins
    fed, _ = fed_columns(tokens, cached, added, jnp.minimum(query_limit, rung), spec, kept, pending)
    total = jnp.sum(jnp.where(live, fed.sum(axis=1), 0))
    chosen = jnp.where(total <= spec.position_budget, jnp.int32(rung), chosen)
  return jnp.minimum(query_limit, chosen)


class Packed(NamedTuple):
  """The window's columns in fed order (`compaction`), padding past each row's count: tokens, positions, ids
  (PAD_ID on padding) and candidate (False on padding), [B, W] each. Every compiled width reads a prefix."""
  tokens: jax.Array
  positions: jax.Array
  ids: jax.Array
  candidate: jax.Array


def compaction(fed: jax.Array, live: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(order, count): order [B, W] the columns with the fed ones first, in column order; count [B] fed
  columns of each live row (0 when done)."""
  order = jnp.argsort(~fed, axis=1, stable=True).astype(jnp.int32)
  return order, jnp.where(live, fed.sum(axis=1), 0).astype(jnp.int32)


def gather(x: jax.Array, order: jax.Array) -> jax.Array:
  """x [B, W, ...] -> its columns in `order` [B, W]."""
  return jnp.take_along_axis(x, order.reshape(order.shape + (1,) * (x.ndim - 2)), axis=1)


def pack(tokens, positions, ids, candidate, order, count) -> Packed:
  """The widest window's tokens, positions, ids and candidates [B, W] gathered into fed order, once for every
  branch of the step and its cache write."""
  real = jnp.arange(order.shape[1])[None, :] < count[:, None]  # [B, W] fed rows; the rest is padding
  return Packed(gather(tokens, order), gather(positions, order), jnp.where(real, gather(ids, order), PAD_ID),
                real & gather(candidate, order))


def forward(model, state, packed: Packed, order, width: int, written, key, knobs, spec: DecodeSpec):
  """One forward over the first `width` packed columns; `written` [B]: the finished blocks' columns, fed
  first, whose K/V the step caches. Returns k, v [L, B, W, K, D] (fed order, padded), the raw output of the
  last column written [B, V], and the choices / confidences [B, W] at the window's columns (confidence -inf
  off the candidates)."""
  batch, full = order.shape
  w_order = order[:, :width]
  raw, (k, v) = model(packed.tokens[:, :width], packed.positions[:, :width], packed.ids[:, :width],
                      state.cache)  # raw [B, w, V]
  last_row = jnp.take_along_axis(raw, jnp.maximum(written - 1, 0)[:, None, None], axis=1)[:, 0]  # [B, V]
  rows = jnp.arange(batch)[:, None]
  if spec.model.logit_shift:  # row r predicts from the output at its column - 1: fed, or the cache's last
    rank = jnp.zeros_like(order).at[rows, order].set(jnp.arange(full, dtype=order.dtype)[None, :])  # inverse
    source = jnp.take_along_axis(rank, jnp.maximum(w_order - 1, 0), axis=1)  # [B, w] row of column - 1
    shifted = jnp.take_along_axis(raw, jnp.minimum(source, width - 1)[..., None], axis=1)  # [B, w, V]
    logits = jnp.where((w_order == 0)[..., None], state.prev_logits[:, None].astype(raw.dtype), shifted)
  else:
    logits = raw
  choice, confidence, _ = choose_tokens(logits, key, knobs, spec.sample)  # [B, w]
  confidence = jnp.where(packed.candidate[:, :width], confidence, -jnp.inf)
  choice = jnp.full((batch, full), spec.model.mask_token_id, choice.dtype).at[rows, w_order].set(choice)
  confidence = jnp.full((batch, full), -jnp.inf, confidence.dtype).at[rows, w_order].set(confidence)
  pad = ((0, 0), (0, 0), (0, full - width), (0, 0), (0, 0))  # [L, B, w, K, D] -> [L, B, W, K, D]
  return jnp.pad(k, pad), jnp.pad(v, pad), last_row, choice, confidence


def step_forward(model, state, tokens, positions, ids, written, key, knobs, spec: DecodeSpec):
  """The forward of a query-limited step and its cache writes: (raw output of the last column written [B, V],
  choices and confidences [B, W] at the window's columns, the cache after, positions computed). tokens,
  positions, ids: [B, W] the widest window's (pipeline._window_inputs); written: [B] its finished
  blocks' columns, whose K/V is written exactly."""
  on = per_row(knobs.cache_decided, 2)  # [B, 1] or a scalar: the rows that keep decided K/V
  slots = window_slots(state.cache.length, spec)  # [B, W] before this step's write
  kept = kept_columns(state.cache.ids, slots) & on if spec.cache_decided else None
  q = within_budget(tokens, state.cached, state.added, ~state.done, knobs.query_limit, spec, kept, state.pending)
  fed, candidate = fed_columns(tokens, state.cached, state.added, q, spec, kept, state.pending)
  order, count = compaction(fed, ~state.done)
  packed = pack(tokens, positions, ids, candidate, order, count)
  index = narrowest(spec.query_widths, jnp.max(count))
  # cache_decided: the forward sees the kept K/V of what it does not feed, never a stale copy of what it does
  view = state.replace(cache=state.cache.hide(jnp.where(fed, slots, DROPPED))) if spec.cache_decided else state
  branches = [lambda _, w=w: forward(model, view, packed, order, w, written, key, knobs, spec)
              for w in spec.query_widths]
  k, v, last_row, choice, confidence = (branches[0](None) if len(branches) == 1
                                        else jax.lax.switch(index, branches, None))
  cache = state.cache.write(k, v, packed.ids, written)  # the finished blocks, first in fed order
  if spec.cache_decided:  # keep the K/V of the decided positions just fed (approximate until written)
    cache = cache.put(k, v, packed.ids, jnp.where(on, kept_slots(packed, slots, order, spec), DROPPED))
  return last_row, choice, confidence, cache, jnp.asarray(spec.query_widths, jnp.int32)[index]
