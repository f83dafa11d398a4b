"""The attention rule and its pure-jnp reference, beside the kernels that implement it.

Key j is visible to query i iff `k_ids[j] <= q_ids[i]` (ids per token; `d2f_jax.models.attention` builds
them for each pattern). PAD_ID (int32 max) marks padding: real queries never see it, pad queries see at
least themselves. The Pallas kernels are tested against `attention_reference` on every row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

PAD_ID = jnp.iinfo(jnp.int32).max
MASK_VALUE = -1e30  # finite, so a (never expected) fully masked row yields a uniform average, not NaN


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
  scores = jnp.where(visible, scores, MASK_VALUE)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
  return out.reshape(batch, q_len, num_heads, head_dim).astype(q.dtype)
