"""Attention patterns as per-token ids (the rule and its pure-jnp reference live in `d2f_jax.kernels.reference`).

Every pattern the project needs is one rule: key j is visible to query i iff `key_ids[j] <= query_ids[i]`.
- bidirectional: every id 0;
- causal: id = position;
- block-causal (D2F student): prompt tokens -1, response token at position p has id (p - prompt_len) // B,
  so prompt rows see the prompt only and a response row sees the prompt, earlier blocks and its own block;
  with `prompt_blocks` (LLaDA2, trained block-causally from position 0) the prompt is cut in blocks of B
  from position 0 too, ids p // B - ceil(prompt_len / B) (all negative: every response row sees all of it);
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

from d2f_jax.kernels.reference import PAD_ID

AttentionMode = Literal["bidirectional", "causal", "block_causal"]
ATTENTION_MODES: tuple[str, ...] = ("bidirectional", "causal", "block_causal")


def attention_ids(
    positions: jax.Array,
    mode: AttentionMode,
    *,
    valid: jax.Array | None = None,
    prompt_len: jax.Array | int | None = None,
    block_size: int | None = None,
    prompt_blocks: bool = False,
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
    ids = jnp.where(positions < prompt_len, prompt_ids(positions, prompt_len, block_size, prompt_blocks),
                    (positions - prompt_len) // block_size)
  else:
    raise ValueError(f"unknown attention mode {mode!r}; expected one of {ATTENTION_MODES}")
  if valid is not None:
    ids = jnp.where(valid, ids, PAD_ID)
  return ids.astype(jnp.int32)


def prompt_ids(positions: jax.Array, prompt_len: jax.Array, block_size: int, blocks: bool) -> jax.Array:
  """Block-causal ids of prompt positions: -1 (the prompt one bidirectional unit, D2F's student), or with
  `blocks` its blocks of `block_size` from position 0, numbered up to -1 (ModelConfig.prompt_blocks)."""
  if not blocks:
    return jnp.full_like(positions, -1)
  return positions // block_size - (prompt_len + block_size - 1) // block_size
