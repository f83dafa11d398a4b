"""Attention patterns as per-token ids, and the pure-jnp attention that is the kernels' reference.

Every pattern the project needs is one rule: key j is visible to query i iff `key_ids[j] <= query_ids[i]`.
- bidirectional: every id 0;
- causal: id = position;
- block-causal (D2F student): prompt tokens -1, response token at position p has id (p - prompt_len) // B,
  so prompt rows see the prompt only and a response row sees the prompt, earlier blocks and its own block;
- padding: id PAD_ID (int32 max) on keys and queries, so real queries never see pads and pad queries see
  at least themselves (no all-masked softmax rows);
- incremental decoding: cache slots keep the ids they were written with (empty slots PAD_ID), the window
  carries its own ids; concatenating both keeps the same rule.
Ids, not dense masks, are what the Pallas kernels consume: the mask is recomputed per tile for free.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

AttentionMode = Literal["bidirectional", "causal", "block_causal"]
ATTENTION_MODES: tuple[str, ...] = ("bidirectional", "causal", "block_causal")
PAD_ID = jnp.iinfo(jnp.int32).max
_MASKED = -1e30  # finite, so a (never expected) fully masked row yields a uniform average, not NaN


def attention_ids(
    positions: jax.Array,
    mode: AttentionMode,
    *,
    valid: jax.Array | None = None,
    prompt_len: jax.Array | int | None = None,
    block_size: int | None = None,
) -> jax.Array:
  """Per-token attention ids [B, T] int32 for `mode`.

  positions: [B, T] position ids (after any left-padding shift); valid: [B, T] bool, False on padding;
  prompt_len: [B] or scalar number of prompt tokens (in position space) for block-causal mode.
  """
  positions = jnp.asarray(positions, jnp.int32)
  if mode == "bidirectional":
    ids = jnp.zeros_like(positions)
  elif mode == "causal":
    ids = positions
  elif mode == "block_causal":
    if prompt_len is None or block_size is None:
      raise ValueError("block_causal attention needs prompt_len and block_size")
    if block_size <= 0:
      raise ValueError(f"block_size must be positive, got {block_size}")
    prompt_len = jnp.asarray(prompt_len, jnp.int32)
    prompt_len = jnp.broadcast_to(prompt_len.reshape(-1, 1) if prompt_len.ndim else prompt_len,
                                  (positions.shape[0], 1))
    ids = jnp.where(positions < prompt_len, -1, (positions - prompt_len) // block_size)
  else:
    raise ValueError(f"unknown attention mode {mode!r}; expected one of {ATTENTION_MODES}")
  if valid is not None:
    ids = jnp.where(valid, ids, PAD_ID)
  return ids.astype(jnp.int32)


def attention_reference(
    q: jax.Array,  # [B, T, H, D]
    k: jax.Array,  # [B, S, K, D]
    v: jax.Array,  # [B, S, K, D]
    q_ids: jax.Array,  # [B, T] int32
    k_ids: jax.Array,  # [B, S] int32
    *,
    scale: float | None = None,
) -> jax.Array:
  """Softmax attention under the id rule, grouped-query, softmax in fp32. Returns [B, T, H, D]."""
  batch, q_len, num_heads, head_dim = q.shape
  num_kv_heads = k.shape[2]
  group = num_heads // num_kv_heads
  scale = head_dim ** -0.5 if scale is None else scale
  q = q.reshape(batch, q_len, num_kv_heads, group, head_dim)
  scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32) * scale
  visible = k_ids[:, None, None, None, :] <= q_ids[:, None, None, :, None]  # [B, 1, 1, T, S]
  scores = jnp.where(visible, scores, _MASKED)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
  return out.reshape(batch, q_len, num_heads, head_dim).astype(q.dtype)
