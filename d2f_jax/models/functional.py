"""Jitted entry points as pure functions of (static graph, parameter state, inputs).

Decoders and trainers call these instead of bound module methods, so the compiled program depends only
on the graph and on input shapes: new weights (a LoRA step, another checkpoint) never recompile.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from d2f_jax.models.attention import AttentionMode, attention_ids
from d2f_jax.models.kv_cache import KVCache
from d2f_jax.models.layers import positions_from_mask
from d2f_jax.models.transformer import align_logits


@functools.partial(jax.jit, static_argnums=0)
def forward(graphdef, state, tokens, positions, ids, cache: KVCache | None = None):
  """Raw logits [B, T, V] (fp32) and the window's K/V [L, B, T, K, D] for explicit positions and ids."""
  model = nnx.merge(graphdef, state)
  return model(tokens, positions, ids, cache)


@functools.partial(jax.jit, static_argnames=("graphdef", "mode", "block_size", "align"))
def logits_for_mode(graphdef, state, tokens, attention_mask, *, mode: AttentionMode,
                    prompt_len=None, block_size: int | None = None, align: bool = True):
  """Logits [B, T, V] for token ids under `mode`, with left padding handled by `attention_mask`.

  Positions are cumsum(mask) - 1 (HF / Dream convention); padding is invisible to real tokens.
  `align=True` applies Dream's logit shift so row i always predicts token i.
  """
  model = nnx.merge(graphdef, state)
  valid = attention_mask.astype(bool)
  positions = positions_from_mask(attention_mask)
  ids = attention_ids(positions, mode, valid=valid, prompt_len=prompt_len, block_size=block_size,
                      prompt_blocks=model.config.prompt_blocks)
  logits, _ = model(tokens, positions, ids)
  if align:
    logits = align_logits(logits, model.config, valid=valid)
  return jnp.where(valid[..., None], logits, 0.0)
