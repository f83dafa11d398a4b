"""Window attention, GPU (Triton) lowering.

Grid (batch, kv head, row tile). A row is one (window token, query head) pair of one kv head, so the G
query heads sharing a kv head read each K/V tile once. The cache is read in place in the model's
[B, S, K, D] layout (or one layer of the stacked [L, B, S, K, D] cache, picked by the block index); the loop over cache tiles stops at the row's valid length, so a short cache costs
little no matter how large it was allocated. The window's own keys are read in tiles of block_k too.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from d2f_jax.kernels.common import MASK_VALUE, finalize, interpret_arg, matmul, online_softmax_step


def _window_kernel(len_ref, q_ref, q_ids_ref, kw_ref, vw_ref, w_ids_ref, kc_ref, vc_ref, c_ids_ref, o_ref, *,
                   scale, block_k, precision):
  # len_ref: [] valid cache slots of this row; q_ref: [bm, D]; q_ids_ref: [bm]
  # kw_ref, vw_ref: [W, D] window keys of this kv head; w_ids_ref: [W]
  # kc_ref, vc_ref: [S, D] the cache of this kv head; c_ids_ref: [S]; o_ref: [bm, D]
  q = q_ref[...]
  q_ids = q_ids_ref[...][:, None]  # [bm, 1]
  rows, head_dim = q.shape
  init = (jnp.full((rows, 1), -jnp.inf, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
          jnp.zeros((rows, head_dim), jnp.float32))

  # The window first, in tiles of at most block_k keys (a whole prefill prompt can be the window: loaded
  # at once, its K/V and scores would overflow shared memory); every real row sees itself there.
  window_block = min(block_k, kw_ref.shape[0])  # both powers of two: it divides W

  def window_body(j, carry):
    tile = pl.ds(pl.multiple_of(j * window_block, window_block), window_block)
    s = matmul(q, kw_ref[tile, :], trans_b=True, precision=precision) * scale  # [bm, wb]
    s = jnp.where(w_ids_ref[tile][None, :] <= q_ids, s, MASK_VALUE)
    return online_softmax_step(*carry, s, vw_ref[tile, :], precision)

  carry = lax.fori_loop(0, kw_ref.shape[0] // window_block, window_body, init)

  length = len_ref[...]

  def body(j, carry):
    start = pl.multiple_of(j * block_k, block_k)
    written = start + jnp.arange(block_k) < length  # [bk]
    tile = pl.ds(start, block_k)
    k = plgpu.load(kc_ref.at[tile, :], mask=written[:, None], other=0.0)
    # Unwritten slots may hold anything (NaN included): zero them so 0-probability * value stays 0.
    v = plgpu.load(vc_ref.at[tile, :], mask=written[:, None], other=0.0)
    visible = written[None, :] & (c_ids_ref[tile][None, :] <= q_ids)  # [bm, bk]
    s = jnp.where(visible, matmul(q, k, trans_b=True, precision=precision) * scale, MASK_VALUE)
    return online_softmax_step(*carry, s, v, precision)

  _, l, acc = lax.fori_loop(0, pl.cdiv(length, block_k), body, carry)
  o_ref[...] = finalize(l, acc).astype(o_ref.dtype)


def window_attention_gpu(rows, row_ids, k_win, v_win, win_ids, cache_k, cache_v, cache_ids, cache_len, *,
                         scale: float, block_q: int, block_k: int, interpret=False, precision=None,
                         layer: int | None = None):
  """rows: [B, K, M, D] (M a multiple of block_q); row_ids: [B, M]; k_win, v_win: [B, K, W, D];
  win_ids: [B, W]; cache_k, cache_v: [B, S, K, D], or [L, B, S, K, D] read at `layer` (S a multiple of
  block_k); cache_ids: [B, S]; cache_len: [B] in [0, S]. Returns [B, K, M, D]."""
  batch, num_kv_heads, num_rows, head_dim = rows.shape
  window = k_win.shape[2]
  cache_size = cache_k.shape[-3]
  if layer is None:
    cache_spec = pl.BlockSpec((None, cache_size, None, head_dim), lambda b, h, i: (b, 0, h, 0))
  else:
    cache_spec = pl.BlockSpec((None, None, cache_size, None, head_dim), lambda b, h, i: (layer, b, 0, h, 0))
  kernel = functools.partial(_window_kernel, scale=scale, block_k=block_k, precision=precision)
  in_specs = [
      pl.BlockSpec((None,), lambda b, h, i: (b,)),
      pl.BlockSpec((None, None, block_q, head_dim), lambda b, h, i: (b, h, i, 0)),
      pl.BlockSpec((None, block_q), lambda b, h, i: (b, i)),
      pl.BlockSpec((None, None, window, head_dim), lambda b, h, i: (b, h, 0, 0)),
      pl.BlockSpec((None, None, window, head_dim), lambda b, h, i: (b, h, 0, 0)),
      pl.BlockSpec((None, window), lambda b, h, i: (b, 0)),
      cache_spec,
      cache_spec,
      pl.BlockSpec((None, cache_size), lambda b, h, i: (b, 0)),
  ]
  return pl.pallas_call(
      kernel,
      grid=(batch, num_kv_heads, num_rows // block_q),
      in_specs=in_specs,
      out_specs=pl.BlockSpec((None, None, block_q, head_dim), lambda b, h, i: (b, h, i, 0)),
      out_shape=jax.ShapeDtypeStruct(rows.shape, rows.dtype),
      compiler_params=plgpu.CompilerParams(num_warps=4 if block_q * head_dim <= 64 * 128 else 8, num_stages=2),
      interpret=interpret_arg(interpret),
      name="d2f_window_attention",
  )(cache_len, rows, row_ids, k_win, v_win, win_ids, cache_k, cache_v, cache_ids)
