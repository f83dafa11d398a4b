"""Numerics shared by every layer: RMSNorm, rotary embeddings, and the SwiGLU MLP.

Kept as pure functions of arrays so the scanned layer body, the decoder and the kernels' references
all use one implementation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  """RMSNorm computed in fp32, cast back to the input dtype, then scaled (LLaDA / Llama / Qwen2 order)."""
  x32 = x.astype(jnp.float32)
  normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
  return normed.astype(x.dtype) * weight.astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, theta: float, rotary_dim: int | None = None) -> jax.Array:
  """Half-split rotary embedding (HF `rotate_half` convention), angles in fp32, over the first `rotary_dim`
  dims of each head (None: the whole head); the rest pass unchanged (LLaDA2's partial rotary).

  x: [B, T, N, D]; positions: [B, T] integer positions (padding may carry any value).
  """
  rotary_dim = x.shape[-1] if rotary_dim is None else rotary_dim
  inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))  # [R/2]
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, R/2]
  cos = jnp.cos(angles)[:, :, None, :]  # [B, T, 1, R/2]
  sin = jnp.sin(angles)[:, :, None, :]
  x1, x2 = jnp.split(x[..., :rotary_dim].astype(jnp.float32), 2, axis=-1)
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
  return rotated if rotary_dim == x.shape[-1] else jnp.concatenate([rotated, x[..., rotary_dim:]], axis=-1)


def positions_from_mask(attention_mask: jax.Array) -> jax.Array:
  """Position ids for left-padded rows: cumsum(mask) - 1, pads clamped to 0 (the Dream / HF convention)."""
  mask = attention_mask.astype(jnp.int32)
  return jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0)
