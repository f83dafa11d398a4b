"""Flash attention under the id rule, TPU (Mosaic) lowering: forward, dK/dV and dQ kernels.

The reduction runs over the last ("arbitrary") grid axis with m / l / acc (or dK, dV, dQ) in VMEM scratch.
Per-tile id statistics (max query id per query tile, min key id per key tile) are scalar-prefetched: a
step whose key tile is invisible to the whole query tile is skipped with `pl.when`, and its index map
points at block 0 instead, so runs of skipped steps copy nothing.

Arrays stay in the model's [B, T, H, D] layout, viewed as [B, T, H * D]: a head is a lane-aligned
column block, so D must be a multiple of 128 (the wrapper pads D otherwise, at the price of a copy).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from d2f_jax.kernels.common import (MASK_VALUE, finalize, interpret_arg, log_sum_exp, matmul, online_softmax_step,
                                    tile_max_ids, tile_min_ids)

_SEMANTICS = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"))


def _visible(q_ids, k_ids, k_start, kv_len, kv_padded):
  """[bq, bk] mask from q_ids [bq, 1] and k_ids [1, bk]; also key position < kv_len if keys were padded."""
  mask = k_ids <= q_ids
  if kv_padded:
    mask &= k_start + lax.broadcasted_iota(jnp.int32, (1, k_ids.shape[1]), 1) < kv_len
  return mask


def _widen(x, pad):
  return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)]) if pad else x


def _as_columns(x):
  """[B, T, H, D] -> [B, T, H * D] (free): head h is the column block h of width D."""
  return x.reshape(*x.shape[:2], -1)


def _forward_kernel(q_max_ref, k_min_ref, q_ref, q_ids_ref, k_ref, v_ref, k_ids_ref, o_ref, lse_ref, m_ref,
                    l_ref, acc_ref, *, scale, block_k, kv_len, kv_padded, precision):
  # q_max_ref: [B, nq], k_min_ref: [B, nk] (SMEM); q_ref: [bq, D]; q_ids_ref: [bq, 1]
  # k_ref, v_ref: [bk, D]; k_ids_ref: [1, bk]; o_ref: [bq, D]; lse_ref: [bq, 1]; scratch m, l [bq, 1], acc [bq, D]
  b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

  @pl.when(j == 0)
  def _init():
    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  @pl.when(k_min_ref[b, j] <= q_max_ref[b, i])
  def _attend():
    s = matmul(q_ref[...], k_ref[...], trans_b=True, precision=precision) * scale  # [bq, bk]
    s = jnp.where(_visible(q_ids_ref[...], k_ids_ref[...], j * block_k, kv_len, kv_padded), s, MASK_VALUE)
    m, l, acc = online_softmax_step(m_ref[...], l_ref[...], acc_ref[...], s, v_ref[...], precision)
    m_ref[...], l_ref[...], acc_ref[...] = m, l, acc

  @pl.when(j == pl.num_programs(3) - 1)
  def _store():
    o_ref[...] = finalize(l_ref[...], acc_ref[...]).astype(o_ref.dtype)
    lse_ref[...] = log_sum_exp(m_ref[...], l_ref[...])


def forward_tpu(q, k, v, q_ids, k_ids, *, scale, block_q, block_k, q_len, kv_len, interpret=False,
                precision=None):
  """q: [B, T, H, D]; k, v: [B, S, K, D] (T, S multiples of the blocks). Returns (o, lse [B, H, T])."""
  batch, seq_q, num_heads, head_dim = q.shape
  seq_k, num_kv_heads = k.shape[1:3]
  group = num_heads // num_kv_heads
  pad = -head_dim % 128
  dp = head_dim + pad
  q, k, v = (_as_columns(_widen(x, pad)) for x in (q, k, v))
  q_max = tile_max_ids(q_ids, block_q, q_len)  # [B, nq]
  k_min = tile_min_ids(k_ids, block_k)  # [B, nk]

  def kv_block(b, i, j, q_max, k_min):
    return jnp.where(k_min[b, j] <= q_max[b, i], j, 0)

  kernel = functools.partial(_forward_kernel, scale=scale, block_k=block_k, kv_len=kv_len,
                             kv_padded=seq_k != kv_len, precision=precision)
  o, lse = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2,
          grid=(batch, num_heads, seq_q // block_q, seq_k // block_k),
          in_specs=[
              pl.BlockSpec((None, block_q, dp), lambda b, h, i, j, *_: (b, i, h)),
              pl.BlockSpec((None, block_q, 1), lambda b, h, i, j, *_: (b, i, 0)),
              pl.BlockSpec((None, block_k, dp), lambda b, h, i, j, *t: (b, kv_block(b, i, j, *t), lax.div(h, group))),
              pl.BlockSpec((None, block_k, dp), lambda b, h, i, j, *t: (b, kv_block(b, i, j, *t), lax.div(h, group))),
              pl.BlockSpec((None, 1, block_k), lambda b, h, i, j, *t: (b, 0, kv_block(b, i, j, *t))),
          ],
          out_specs=[
              pl.BlockSpec((None, block_q, dp), lambda b, h, i, j, *_: (b, i, h)),
              pl.BlockSpec((None, None, block_q, 1), lambda b, h, i, j, *_: (b, h, i, 0)),
          ],
          scratch_shapes=[pltpu.VMEM((block_q, 1), jnp.float32), pltpu.VMEM((block_q, 1), jnp.float32),
                          pltpu.VMEM((block_q, dp), jnp.float32)],
      ),
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((batch, num_heads, seq_q, 1), jnp.float32)],
      compiler_params=_SEMANTICS,
      interpret=interpret_arg(interpret),
      name="d2f_flash_forward",
  )(q_max, k_min, q, q_ids[:, :, None], k, v, k_ids[:, None, :])
  o = o.reshape(batch, seq_q, num_heads, dp)[..., :head_dim]
  return o, lse[..., 0]


def _dkv_kernel(q_max_ref, k_min_ref, q_ref, q_ids_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, k_ids_ref,
                dk_ref, dv_ref, dk_acc, dv_acc, *, scale, num_q_tiles, block_k, kv_len, kv_padded, precision):
  # Step r of the last axis is (query head r // nq of the group, query tile r % nq): dK/dV of one key tile
  # accumulate over all G query heads that share it. q_ref, do_ref: [bq, D]; q_ids_ref, lse_ref,
  # delta_ref: [bq, 1]; k_ref, v_ref: [bk, D]; k_ids_ref: [1, bk]; scratch dk_acc, dv_acc: [bk, D] fp32
  b, j, r = pl.program_id(0), pl.program_id(2), pl.program_id(3)

  @pl.when(r == 0)
  def _init():
    dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
    dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

  @pl.when(k_min_ref[b, j] <= q_max_ref[b, lax.rem(r, num_q_tiles)])
  def _accumulate():
    q, do = q_ref[...], do_ref[...]
    s = matmul(q, k_ref[...], trans_b=True, precision=precision) * scale  # [bq, bk]
    visible = _visible(q_ids_ref[...], k_ids_ref[...], j * block_k, kv_len, kv_padded)
    p = jnp.where(visible, jnp.exp(s - lse_ref[...]), 0.0)
    dv_acc[...] += matmul(p.T.astype(do.dtype), do, precision=precision)
    dp = matmul(do, v_ref[...], trans_b=True, precision=precision)
    ds = p * (dp - delta_ref[...]) * scale
    dk_acc[...] += matmul(ds.T.astype(q.dtype), q, precision=precision)

  @pl.when(r == pl.num_programs(3) - 1)
  def _store():
    dk_ref[...] = dk_acc[...].astype(dk_ref.dtype)
    dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


def _dq_kernel(q_max_ref, k_min_ref, q_ref, q_ids_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, k_ids_ref,
               dq_ref, dq_acc, *, scale, block_k, kv_len, kv_padded, precision):
  # q_ref, do_ref: [bq, D]; q_ids_ref, lse_ref, delta_ref: [bq, 1]; k_ref, v_ref: [bk, D]; k_ids_ref: [1, bk]
  b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

  @pl.when(j == 0)
  def _init():
    dq_acc[...] = jnp.zeros(dq_acc.shape, jnp.float32)

  @pl.when(k_min_ref[b, j] <= q_max_ref[b, i])
  def _accumulate():
    k = k_ref[...]
    s = matmul(q_ref[...], k, trans_b=True, precision=precision) * scale
    visible = _visible(q_ids_ref[...], k_ids_ref[...], j * block_k, kv_len, kv_padded)
    p = jnp.where(visible, jnp.exp(s - lse_ref[...]), 0.0)
    dp = matmul(do_ref[...], v_ref[...], trans_b=True, precision=precision)
    ds = p * (dp - delta_ref[...]) * scale
    dq_acc[...] += matmul(ds.astype(k.dtype), k, precision=precision)

  @pl.when(j == pl.num_programs(3) - 1)
  def _store():
    dq_ref[...] = dq_acc[...].astype(dq_ref.dtype)


def backward_tpu(q, k, v, q_ids, k_ids, do, lse, delta, *, scale, block_q_dkv, block_k_dkv, block_q_dq,
                 block_k_dq, q_len, kv_len, interpret=False, precision=None):
  """Gradients (dq, dk, dv) given the forward's lse [B, H, T] and delta = rowsum(o * do) [B, H, T]."""
  batch, seq_q, num_heads, head_dim = q.shape
  seq_k, num_kv_heads = k.shape[1:3]
  group = num_heads // num_kv_heads
  pad = -head_dim % 128
  dp = head_dim + pad
  q, k, v, do = (_as_columns(_widen(x, pad)) for x in (q, k, v, do))
  lse, delta = lse[..., None], delta[..., None]  # [B, H, T, 1]
  q_ids3, k_ids3 = q_ids[:, :, None], k_ids[:, None, :]
  common = dict(scale=scale, kv_len=kv_len, kv_padded=seq_k != kv_len, precision=precision)

  nq = seq_q // block_q_dkv
  q_max = tile_max_ids(q_ids, block_q_dkv, q_len)
  k_min = tile_min_ids(k_ids, block_k_dkv)
  # Step r of the last axis: query head h * G + r // nq, query tile r % nq (non-negative: lax.div / rem).
  row = lambda b, h, j, r, *_: (b, lax.rem(r, nq), h * group + lax.div(r, nq))
  stat = lambda b, h, j, r, *_: (b, h * group + lax.div(r, nq), lax.rem(r, nq), 0)
  key = lambda b, h, j, r, *_: (b, j, h)
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, num_q_tiles=nq, block_k=block_k_dkv, **common),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2,
          grid=(batch, num_kv_heads, seq_k // block_k_dkv, group * nq),
          in_specs=[
              pl.BlockSpec((None, block_q_dkv, dp), row),
              pl.BlockSpec((None, block_q_dkv, 1), lambda b, h, j, r, *_: (b, lax.rem(r, nq), 0)),
              pl.BlockSpec((None, block_q_dkv, dp), row),
              pl.BlockSpec((None, None, block_q_dkv, 1), stat),
              pl.BlockSpec((None, None, block_q_dkv, 1), stat),
              pl.BlockSpec((None, block_k_dkv, dp), key),
              pl.BlockSpec((None, block_k_dkv, dp), key),
              pl.BlockSpec((None, 1, block_k_dkv), lambda b, h, j, r, *_: (b, 0, j)),
          ],
          out_specs=[pl.BlockSpec((None, block_k_dkv, dp), key)] * 2,
          scratch_shapes=[pltpu.VMEM((block_k_dkv, dp), jnp.float32)] * 2,
      ),
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      compiler_params=_SEMANTICS,
      interpret=interpret_arg(interpret),
      name="d2f_flash_backward_dkv",
  )(q_max, k_min, q, q_ids3, do, lse, delta, k, v, k_ids3)

  q_max = tile_max_ids(q_ids, block_q_dq, q_len)
  k_min = tile_min_ids(k_ids, block_k_dq)

  def kv_block(b, i, j, q_max, k_min):
    return jnp.where(k_min[b, j] <= q_max[b, i], j, 0)

  row = lambda b, h, i, j, *_: (b, i, h)
  stat = lambda b, h, i, j, *_: (b, h, i, 0)
  key = lambda b, h, i, j, *t: (b, kv_block(b, i, j, *t), lax.div(h, group))
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, block_k=block_k_dq, **common),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2,
          grid=(batch, num_heads, seq_q // block_q_dq, seq_k // block_k_dq),
          in_specs=[
              pl.BlockSpec((None, block_q_dq, dp), row),
              pl.BlockSpec((None, block_q_dq, 1), lambda b, h, i, j, *_: (b, i, 0)),
              pl.BlockSpec((None, block_q_dq, dp), row),
              pl.BlockSpec((None, None, block_q_dq, 1), stat),
              pl.BlockSpec((None, None, block_q_dq, 1), stat),
              pl.BlockSpec((None, block_k_dq, dp), key),
              pl.BlockSpec((None, block_k_dq, dp), key),
              pl.BlockSpec((None, 1, block_k_dq), lambda b, h, i, j, *t: (b, 0, kv_block(b, i, j, *t))),
          ],
          out_specs=pl.BlockSpec((None, block_q_dq, dp), row),
          scratch_shapes=[pltpu.VMEM((block_q_dq, dp), jnp.float32)],
      ),
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      compiler_params=_SEMANTICS,
      interpret=interpret_arg(interpret),
      name="d2f_flash_backward_dq",
  )(q_max, k_min, q, q_ids3, do, lse, delta, k, v, k_ids3)
  unview = lambda x, heads: x.reshape(batch, x.shape[1], heads, dp)[..., :head_dim]
  return unview(dq, num_heads), unview(dk, num_kv_heads), unview(dv, num_kv_heads)
