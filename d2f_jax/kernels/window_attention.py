"""Window attention for incremental decoding: a fixed-size window of queries against the KV cache plus
the window's own keys, under the id rule (block-causal inside the window), with grouped-query heads.

The cache is static-size [B, S, K, D] with slots [0, cache_len[b]) written. The kernels never read past
`cache_len`, which is what makes decoding with a large, mostly empty cache cheap. The cache may also be the
model's whole stacked cache [L, B, S, K, D] with a static `layer` (or, on TPU, a traced `layer_index`): the
kernels then read that layer in place, where slicing it first would copy the layer's cache (a Pallas call
takes only whole buffers) on every call.

Contract (also what the reference computes): key visible to query i iff its id <= q_ids[i], and, for a
cache slot, slot < cache_len. Queries whose id is PAD_ID are padding: the reference lets them see every
cache slot, the kernels only the written ones, so their (finite) outputs are unspecified. Real rows never
see PAD_ID keys, so padding never changes them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from d2f_jax.kernels.block_sizes import BlockSizes, fit_block
from d2f_jax.kernels.common import (PAD_ID, check_array, check_float, check_gqa, matmul_precision, next_pow2,
                                    pad_axis, resolve_backend, round_up)
from d2f_jax.kernels.window_attention_gpu import window_attention_gpu
from d2f_jax.kernels.window_attention_tpu import window_attention_tpu
from d2f_jax.kernels.reference import attention_reference


def window_attention_reference(q, k_win, v_win, q_ids, win_ids, cache_k, cache_v, cache_ids, cache_len, *,
                               scale=None):
  """Concatenate cache and window and run `attention_reference`; slots past cache_len get PAD_ID."""
  written = jnp.arange(cache_ids.shape[1])[None, :] < cache_len[:, None]  # [B, S]
  ids = jnp.concatenate([jnp.where(written, cache_ids, PAD_ID), win_ids], axis=1)  # [B, S + Tw]
  k = jnp.concatenate([cache_k, k_win], axis=1)  # [B, S + Tw, K, D]
  v = jnp.concatenate([cache_v, v_win], axis=1)
  return attention_reference(q, k, v, q_ids, ids, scale=scale)


def _check_args(q, k_win, v_win, q_ids, win_ids, cache_k, cache_v, cache_ids, cache_len, layer, layer_index):
  if getattr(q, "ndim", None) != 4:
    raise ValueError(f"q must have shape [B, Tw, H, D], got {list(getattr(q, 'shape', ()))}")
  batch, window, num_heads, head_dim = q.shape
  if getattr(k_win, "ndim", None) != 4:
    raise ValueError(f"k_win must have shape [B, Tw, K, D], got {list(getattr(k_win, 'shape', ()))}")
  num_kv_heads = k_win.shape[2]
  check_gqa(num_heads, num_kv_heads)
  check_array("k_win", k_win, (batch, window, num_kv_heads, head_dim))
  check_array("v_win", v_win, (batch, window, num_kv_heads, head_dim))
  check_array("q_ids", q_ids, (batch, window), jnp.int32)
  check_array("win_ids", win_ids, (batch, window), jnp.int32)
  if layer is not None and layer_index is not None:
    raise ValueError("pass layer (a static int) or layer_index (a traced int32 scalar), not both")
  if layer is None and layer_index is None:
    if getattr(cache_k, "ndim", None) == 5:
      raise ValueError(f"cache_k of shape {list(cache_k.shape)} is a stacked [L, B, S, K, D] cache: pass layer= "
                       "to read one of its layers")
    lead = ()
  else:
    if layer_index is not None:
      check_array("layer_index", layer_index, (), jnp.int32)
    elif not isinstance(layer, int) or not 0 <= layer < getattr(cache_k, "shape", (0,))[0]:
      raise ValueError(f"layer must be an int indexing cache_k's leading [L] axis, got {layer!r} for cache_k "
                       f"of shape {list(getattr(cache_k, 'shape', ()))}")
    lead = (cache_k.shape[0],)
  check_array("cache_k", cache_k, (*lead, batch, None, num_kv_heads, head_dim))
  cache_size = cache_k.shape[-3]
  check_array("cache_v", cache_v, (*lead, batch, cache_size, num_kv_heads, head_dim))
  check_array("cache_ids", cache_ids, (batch, cache_size), jnp.int32)
  check_array("cache_len", cache_len, (batch,), jnp.int32)
  check_float("q", q, q.dtype)
  for name, x in (("k_win", k_win), ("v_win", v_win), ("cache_k", cache_k), ("cache_v", cache_v)):
    check_float(name, x, q.dtype)


@functools.partial(jax.jit, static_argnames=("layer", "scale", "impl", "interpret", "block_sizes", "platform"))
def window_attention(q, k_win, v_win, q_ids, win_ids, cache_k, cache_v, cache_ids, cache_len, *,
                     layer: int | None = None, layer_index: jax.Array | None = None, scale: float | None = None,
                     impl: str = "auto", interpret=False,
                     block_sizes: BlockSizes | None = None, platform: str | None = None):
  """Attention of a decoding window to the KV cache and to itself.

  q: [B, Tw, H, D]; k_win, v_win: [B, Tw, K, D] the window's keys; q_ids, win_ids: [B, Tw] int32 (usually
  the same array); cache_k, cache_v: [B, S, K, D], or [L, B, S, K, D] read at `layer` (a static int) or
  `layer_index` (a traced int32 scalar: a layer loop's counter; the TPU kernel reads it in place, the GPU
  kernel's index maps need a static layer, so there the layer is sliced out: a copy);
  cache_ids: [B, S] int32; cache_len: [B] int32.
  impl: "auto" (Pallas on GPU/TPU, reference on CPU) | "xla" | "pallas"; interpret: False | "gpu" | "tpu";
  platform: the device platform to dispatch for (default: the default backend's).
  Returns [B, Tw, H, D] in q's dtype.

  For speed choose S a multiple of block_k (the cache is otherwise padded, i.e. copied, on every call).
  """
  _check_args(q, k_win, v_win, q_ids, win_ids, cache_k, cache_v, cache_ids, cache_len, layer, layer_index)
  backend = resolve_backend(impl, interpret, platform)
  stacked = layer if layer is not None else layer_index  # the layer to read, or None for an unstacked cache
  if stacked is not None and (backend == "xla" or (backend == "gpu" and layer is None)):
    cache_k, cache_v, stacked = cache_k[stacked], cache_v[stacked], None
  if backend == "xla":
    return window_attention_reference(q, k_win, v_win, q_ids, win_ids, cache_k, cache_v, cache_ids,
                                      cache_len, scale=scale)
  batch, window, num_heads, head_dim = q.shape
  cache_size, num_kv_heads = cache_k.shape[-3:-1]
  group = num_heads // num_kv_heads
  if backend == "gpu" and (head_dim < 16 or head_dim & (head_dim - 1)):
    raise ValueError(f"the GPU (Triton) kernel needs head_dim a power of two >= 16, got {head_dim}")
  sizes = (block_sizes or BlockSizes.get_default(backend, "window")).validate(backend, backward=False)
  scale = head_dim ** -0.5 if scale is None else float(scale)

  # Rows: the G query heads of one kv head for every window token, token-major: row r is token r // G.
  rows = q.reshape(batch, window, num_kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
  rows = rows.reshape(batch, num_kv_heads, window * group, head_dim)  # [B, K, Tw * G, D]
  row_ids = jnp.repeat(q_ids, group, axis=1)  # [B, Tw * G]
  num_rows = window * group
  block_q = fit_block(sizes.block_q, num_rows, backend, "q")
  padded_rows = round_up(num_rows, block_q)
  rows = pad_axis(rows, 2, padded_rows)
  row_ids = pad_axis(row_ids, 1, padded_rows, PAD_ID)

  # The window's keys, head-major and padded to one tile (padding keys are PAD_ID, invisible to real rows).
  padded_window = next_pow2(max(window, 16)) if backend == "gpu" else round_up(window, 8)
  k_win = pad_axis(k_win.transpose(0, 2, 1, 3), 2, padded_window)  # [B, K, W, D]
  v_win = pad_axis(v_win.transpose(0, 2, 1, 3), 2, padded_window)
  win_ids = pad_axis(win_ids, 1, padded_window, PAD_ID)

  block_k = fit_block(sizes.block_k, cache_size, backend, "k")
  padded_cache = round_up(cache_size, block_k)
  if stacked is not None and (padded_cache != cache_size or (backend == "tpu" and head_dim % 128)):
    # The cache must be padded (S or, on TPU, D): copy this layer alone rather than the whole stack.
    cache_k, cache_v, stacked = cache_k[stacked], cache_v[stacked], None
  cache_k = pad_axis(cache_k, cache_k.ndim - 3, padded_cache)
  cache_v = pad_axis(cache_v, cache_v.ndim - 3, padded_cache)
  cache_ids = pad_axis(cache_ids, 1, padded_cache, PAD_ID)
  cache_len = jnp.clip(cache_len, 0, cache_size)

  lowering = window_attention_gpu if backend == "gpu" else window_attention_tpu
  out = lowering(rows, row_ids, k_win, v_win, win_ids, cache_k, cache_v, cache_ids, cache_len, scale=scale,
                 block_q=block_q, block_k=block_k, interpret=interpret, precision=matmul_precision(q.dtype),
                 layer=stacked)
  out = out[:, :, :num_rows].reshape(batch, num_kv_heads, window, group, head_dim)
  return out.transpose(0, 2, 1, 3, 4).reshape(batch, window, num_heads, head_dim)
