"""Window attention, TPU (Mosaic) lowering.

Grid (batch, kv head, row tile, step): step 0 attends to the window's own keys, step j >= 1 to cache
tile j - 1. The per-row valid cache lengths are scalar-prefetched: the cache index map clamps to the
last valid tile, so tiles past the length repeat the previous block index and are never copied, and
`pl.when` skips their compute. The cache is read in place: its [B, S, K, D] layout is viewed as
[B, S, K * D] and a kv head is a 128-lane-aligned column block of that view (so D % 128 == 0; the
wrapper pads D otherwise). A stacked [L, B, S, K, D] cache is viewed as [L, B, S, K * D] and read at
`layer`, scalar-prefetched too, so a layer loop's traced counter reads its layer in place. m / l / acc live
in VMEM scratch across the steps.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from d2f_jax.kernels.common import MASK_VALUE, finalize, interpret_arg, matmul, online_softmax_step


def _window_kernel(len_ref, layer_ref, q_ref, q_ids_ref, kw_ref, vw_ref, w_ids_ref, kc_ref, vc_ref, c_ids_ref,
                   o_ref, m_ref, l_ref, acc_ref, *, scale, block_k, num_steps, precision):
  # len_ref: [B], layer_ref: [1] (SMEM; the layer is read by the index maps only); q_ref: [bm, D]
  # q_ids_ref: [bm, 1]; kw_ref, vw_ref: [W, D]; w_ids_ref: [1, W]
  # kc_ref, vc_ref: [bk, D] one cache tile of this kv head; c_ids_ref: [1, bk]; o_ref: [bm, D]
  # m_ref, l_ref: [bm, 1] and acc_ref: [bm, D] fp32 scratch
  step = pl.program_id(3)
  length = len_ref[pl.program_id(0)]
  q_ids = q_ids_ref[...]

  @pl.when(step == 0)
  def _window():
    q = q_ref[...]
    rows, head_dim = q.shape
    s = matmul(q, kw_ref[...], trans_b=True, precision=precision) * scale  # [bm, W]
    s = jnp.where(w_ids_ref[...] <= q_ids, s, MASK_VALUE)
    m, l, acc = online_softmax_step(
        jnp.full((rows, 1), -jnp.inf, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
        jnp.zeros((rows, head_dim), jnp.float32), s, vw_ref[...], precision)
    m_ref[...], l_ref[...], acc_ref[...] = m, l, acc

  start = (step - 1) * block_k

  @pl.when((step > 0) & (start < length))
  def _cache_tile():
    written = start + lax.broadcasted_iota(jnp.int32, (1, block_k), 1) < length  # [1, bk]
    written_col = start + lax.broadcasted_iota(jnp.int32, (block_k, 1), 0) < length  # [bk, 1]
    # Unwritten slots may hold anything (NaN included): zero them so 0-probability * value stays 0.
    v = jnp.where(written_col, vc_ref[...], 0).astype(vc_ref.dtype)
    visible = written & (c_ids_ref[...] <= q_ids)  # [bm, bk]
    s = matmul(q_ref[...], kc_ref[...], trans_b=True, precision=precision) * scale
    s = jnp.where(visible, s, MASK_VALUE)
    m, l, acc = online_softmax_step(m_ref[...], l_ref[...], acc_ref[...], s, v, precision)
    m_ref[...], l_ref[...], acc_ref[...] = m, l, acc

  @pl.when(step == num_steps - 1)
  def _store():
    o_ref[...] = finalize(l_ref[...], acc_ref[...]).astype(o_ref.dtype)


def window_attention_tpu(rows, row_ids, k_win, v_win, win_ids, cache_k, cache_v, cache_ids, cache_len, *,
                         scale: float, block_q: int, block_k: int, interpret=False, precision=None,
                         layer: int | jax.Array | None = None):
  """Same contract as `window_attention_gpu`: rows [B, K, M, D] -> [B, K, M, D]; S a multiple of block_k;
  a stacked cache (`layer` given: a static int or a traced int32 scalar) needs D % 128 == 0 (the wrapper
  slices the layer out otherwise)."""
  batch, num_kv_heads, num_rows, head_dim = rows.shape
  cache_size = cache_k.shape[-3]
  pad_d = -head_dim % 128
  if pad_d and layer is not None:
    raise ValueError(f"a stacked cache needs head_dim a multiple of 128 on TPU, got {head_dim}")
  if pad_d:  # a kv head must be a lane-aligned column block of the cache view (a copy; D=128 models skip it)
    widen = lambda x: jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad_d)])
    rows, k_win, v_win, cache_k, cache_v = map(widen, (rows, k_win, v_win, cache_k, cache_v))
  dp = head_dim + pad_d
  window = k_win.shape[2]
  num_tiles = cache_size // block_k
  num_steps = 1 + num_tiles

  def cache_tile(step, length):
    """Step j >= 1 reads tile j - 1, clamped to the last valid one: a repeated index is not re-copied."""
    last = jnp.maximum(pl.cdiv(length, block_k) - 1, 0)
    return jnp.minimum(jnp.maximum(step - 1, 0), last)

  lead = cache_k.shape[:-3]  # (B,) or (L, B)
  if layer is None:
    cache_spec = pl.BlockSpec((None, block_k, dp), lambda b, h, i, j, lens, lay: (b, cache_tile(j, lens[b]), h))
  else:
    cache_spec = pl.BlockSpec((None, None, block_k, dp),
                              lambda b, h, i, j, lens, lay: (lay[0], b, cache_tile(j, lens[b]), h))
  in_specs = [
      pl.BlockSpec((None, None, block_q, dp), lambda b, h, i, j, lens, lay: (b, h, i, 0)),
      pl.BlockSpec((None, block_q, 1), lambda b, h, i, j, lens, lay: (b, i, 0)),
      pl.BlockSpec((None, None, window, dp), lambda b, h, i, j, lens, lay: (b, h, 0, 0)),
      pl.BlockSpec((None, None, window, dp), lambda b, h, i, j, lens, lay: (b, h, 0, 0)),
      pl.BlockSpec((None, 1, window), lambda b, h, i, j, lens, lay: (b, 0, 0)),
      cache_spec,
      cache_spec,
      pl.BlockSpec((None, 1, block_k), lambda b, h, i, j, lens, lay: (b, 0, cache_tile(j, lens[b]))),
  ]
  kernel = functools.partial(_window_kernel, scale=scale, block_k=block_k, num_steps=num_steps,
                             precision=precision)
  out = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2,
          grid=(batch, num_kv_heads, num_rows // block_q, num_steps),
          in_specs=in_specs,
          out_specs=pl.BlockSpec((None, None, block_q, dp), lambda b, h, i, j, lens, lay: (b, h, i, 0)),
          scratch_shapes=[pltpu.VMEM((block_q, 1), jnp.float32), pltpu.VMEM((block_q, 1), jnp.float32),
                          pltpu.VMEM((block_q, dp), jnp.float32)],
      ),
      out_shape=jax.ShapeDtypeStruct(rows.shape, rows.dtype),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
      interpret=interpret_arg(interpret),
      name="d2f_window_attention",
  )(cache_len, jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(1),  # the index maps' scalars
    rows, row_ids[:, :, None], k_win, v_win, win_ids[:, None, :],
    cache_k.reshape(*lead, cache_size, num_kv_heads * dp), cache_v.reshape(*lead, cache_size, num_kv_heads * dp),
    cache_ids[:, None, :])
  return out[..., :head_dim] if pad_d else out
