"""Flash attention under the id rule, GPU (Triton) lowering: forward, dK/dV and dQ kernels.

Arrays stay in the model's [B, T, H, D] layout (Triton reads strided tiles); a query head h uses kv
head h // G through the index maps. Each program loops over the tiles of the other sequence and skips
a tile when it is invisible as a whole: min(key ids of the tile) > max(query ids of the tile).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from d2f_jax.kernels.common import (MASK_VALUE, MIN_ID, finalize, interpret_arg, log_sum_exp, matmul,
                                    online_softmax_step)


def _num_warps(block_q, block_k, head_dim):
  return 4 if max(block_q, block_k) * head_dim <= 64 * 128 else 8


def _query_tile_max(q_ids, start, q_len):
  """Max query id of a tile, ignoring the rows the wrapper padded on (they never force a tile in)."""
  rows = start + jnp.arange(q_ids.shape[0])
  return jnp.max(jnp.where(rows < q_len, q_ids, MIN_ID))


def _visible(q_ids, k_ids, k_start, kv_len, kv_padded):
  """[bq, bk] mask: the id rule, and (when the wrapper padded keys) key position < kv_len."""
  mask = k_ids[None, :] <= q_ids[:, None]
  if kv_padded:
    mask &= (k_start + jnp.arange(k_ids.shape[0]) < kv_len)[None, :]
  return mask


def _over_visible_key_tiles(k_ids_ref, q_max, block_k: int, kv_size: int, visit, init):
  """fori over the key tiles of [S] ids, calling visit(start, k_ids, carry) only on tiles some query of the
  tile can see (min key id <= q_max); the rest are skipped, which is what makes block-causal cheap."""
  def body(j, carry):
    start = pl.multiple_of(j * block_k, block_k)
    k_ids = k_ids_ref[pl.ds(start, block_k)]
    return lax.cond(jnp.min(k_ids) <= q_max, lambda c: visit(start, k_ids, c), lambda c: c, carry)
  return lax.fori_loop(0, kv_size // block_k, body, init)


def _forward_kernel(q_ref, q_ids_ref, k_ref, v_ref, k_ids_ref, o_ref, lse_ref, *, scale, block_k, q_len,
                    kv_len, precision):
  # q_ref: [bq, D]; q_ids_ref: [bq]; k_ref, v_ref: [S, D] (kv head h // G); k_ids_ref: [S]
  # o_ref: [bq, D]; lse_ref: [bq] fp32 log-sum-exp of the scaled scores, the backward's residual
  block_q, head_dim = q_ref.shape
  kv_size = k_ref.shape[0]
  q = q_ref[...]
  q_ids = q_ids_ref[...]
  q_max = _query_tile_max(q_ids, pl.program_id(2) * block_q, q_len)

  def attend(start, k_ids, carry):
    k = k_ref[pl.ds(start, block_k), :]
    v = v_ref[pl.ds(start, block_k), :]
    s = matmul(q, k, trans_b=True, precision=precision) * scale  # [bq, bk]
    s = jnp.where(_visible(q_ids, k_ids, start, kv_len, kv_size != kv_len), s, MASK_VALUE)
    return online_softmax_step(*carry, s, v, precision)

  init = (jnp.full((block_q, 1), -jnp.inf, jnp.float32), jnp.zeros((block_q, 1), jnp.float32),
          jnp.zeros((block_q, head_dim), jnp.float32))
  m, l, acc = _over_visible_key_tiles(k_ids_ref, q_max, block_k, kv_size, attend, init)
  o_ref[...] = finalize(l, acc).astype(o_ref.dtype)
  lse_ref[...] = jnp.squeeze(log_sum_exp(m, l), 1)


def forward_gpu(q, k, v, q_ids, k_ids, *, scale, block_q, block_k, q_len, kv_len, interpret=False,
                precision=None):
  """q: [B, T, H, D]; k, v: [B, S, K, D]; ids int32 (T, S multiples of the blocks). Returns
  (o [B, T, H, D], lse [B, H, T] fp32)."""
  batch, seq_q, num_heads, head_dim = q.shape
  seq_k, num_kv_heads = k.shape[1:3]
  group = num_heads // num_kv_heads
  kernel = functools.partial(_forward_kernel, scale=scale, block_k=block_k, q_len=q_len, kv_len=kv_len,
                             precision=precision)
  return pl.pallas_call(
      kernel,
      grid=(batch, num_heads, seq_q // block_q),
      in_specs=[
          pl.BlockSpec((None, block_q, None, head_dim), lambda b, h, i: (b, i, h, 0)),
          pl.BlockSpec((None, block_q), lambda b, h, i: (b, i)),
          pl.BlockSpec((None, seq_k, None, head_dim), lambda b, h, i: (b, 0, lax.div(h, group), 0)),
          pl.BlockSpec((None, seq_k, None, head_dim), lambda b, h, i: (b, 0, lax.div(h, group), 0)),
          pl.BlockSpec((None, seq_k), lambda b, h, i: (b, 0)),
      ],
      out_specs=[
          pl.BlockSpec((None, block_q, None, head_dim), lambda b, h, i: (b, i, h, 0)),
          pl.BlockSpec((None, None, block_q), lambda b, h, i: (b, h, i)),
      ],
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((batch, num_heads, seq_q), jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=_num_warps(block_q, block_k, head_dim), num_stages=2),
      interpret=interpret_arg(interpret),
      name="d2f_flash_forward",
  )(q, q_ids, k, v, k_ids)


def _dkv_kernel(q_ref, q_ids_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, k_ids_ref, dk_ref, dv_ref, *,
                scale, block_q, group, q_len, kv_len, kv_padded, precision):
  # q_ref, do_ref: [T, H, D] all heads of this batch row; q_ids_ref: [T]; lse_ref, delta_ref: [H, T]
  # k_ref, v_ref: [bk, D] one key tile of kv head h; k_ids_ref: [bk]; dk_ref, dv_ref: [bk, D]
  # Loops over (query head of the group, query tile) pairs, so the G heads' gradients sum in registers.
  block_k, head_dim = k_ref.shape
  seq_q = q_ref.shape[0]
  num_q_tiles = seq_q // block_q
  kv_head = pl.program_id(1)
  k_start = pl.program_id(2) * block_k
  k, v = k_ref[...], v_ref[...]
  k_ids = k_ids_ref[...]
  k_min = jnp.min(k_ids)

  def body(r, carry):
    head = kv_head * group + lax.div(r, num_q_tiles)
    start = pl.multiple_of(lax.rem(r, num_q_tiles) * block_q, block_q)
    q_ids = q_ids_ref[pl.ds(start, block_q)]

    def accumulate(carry):
      dk, dv = carry
      q = q_ref[pl.ds(start, block_q), head, :]
      do = do_ref[pl.ds(start, block_q), head, :]
      lse = lse_ref[head, pl.ds(start, block_q)][:, None]  # [bq, 1]
      delta = delta_ref[head, pl.ds(start, block_q)][:, None]
      s = matmul(q, k, trans_b=True, precision=precision) * scale  # [bq, bk]
      visible = _visible(q_ids, k_ids, k_start, kv_len, kv_padded)
      p = jnp.where(visible, jnp.exp(s - lse), 0.0)
      dv = dv + matmul(p.astype(do.dtype), do, trans_a=True, precision=precision)
      dp = matmul(do, v, trans_b=True, precision=precision)
      ds = p * (dp - delta) * scale
      dk = dk + matmul(ds.astype(q.dtype), q, trans_a=True, precision=precision)
      return dk, dv

    return lax.cond(k_min <= _query_tile_max(q_ids, start, q_len), accumulate, lambda c: c, carry)

  zeros = jnp.zeros((block_k, head_dim), jnp.float32)
  dk, dv = lax.fori_loop(0, group * num_q_tiles, body, (zeros, zeros))
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(q_ref, q_ids_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, k_ids_ref, dq_ref, *, scale,
               block_k, q_len, kv_len, precision):
  # q_ref, do_ref: [bq, D]; q_ids_ref, lse_ref, delta_ref: [bq]; k_ref, v_ref: [S, D]; k_ids_ref: [S]
  block_q, head_dim = q_ref.shape
  kv_size = k_ref.shape[0]
  q, do = q_ref[...], do_ref[...]
  q_ids = q_ids_ref[...]
  lse = lse_ref[...][:, None]
  delta = delta_ref[...][:, None]
  q_max = _query_tile_max(q_ids, pl.program_id(2) * block_q, q_len)

  def accumulate(start, k_ids, dq):
    k = k_ref[pl.ds(start, block_k), :]
    v = v_ref[pl.ds(start, block_k), :]
    s = matmul(q, k, trans_b=True, precision=precision) * scale
    p = jnp.where(_visible(q_ids, k_ids, start, kv_len, kv_size != kv_len), jnp.exp(s - lse), 0.0)
    ds = p * (matmul(do, v, trans_b=True, precision=precision) - delta) * scale
    return dq + matmul(ds.astype(k.dtype), k, precision=precision)

  dq = _over_visible_key_tiles(k_ids_ref, q_max, block_k, kv_size, accumulate,
                               jnp.zeros((block_q, head_dim), jnp.float32))
  dq_ref[...] = dq.astype(dq_ref.dtype)


def backward_gpu(q, k, v, q_ids, k_ids, do, lse, delta, *, scale, block_q_dkv, block_k_dkv, block_q_dq,
                 block_k_dq, q_len, kv_len, interpret=False, precision=None):
  """Gradients (dq, dk, dv) given the forward's lse [B, H, T] and delta = rowsum(o * do) [B, H, T]."""
  batch, seq_q, num_heads, head_dim = q.shape
  seq_k, num_kv_heads = k.shape[1:3]
  group = num_heads // num_kv_heads
  common = dict(scale=scale, q_len=q_len, kv_len=kv_len, precision=precision)
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, block_q=block_q_dkv, group=group, kv_padded=seq_k != kv_len, **common),
      grid=(batch, num_kv_heads, seq_k // block_k_dkv),
      in_specs=[
          pl.BlockSpec((None, seq_q, num_heads, head_dim), lambda b, h, j: (b, 0, 0, 0)),
          pl.BlockSpec((None, seq_q), lambda b, h, j: (b, 0)),
          pl.BlockSpec((None, seq_q, num_heads, head_dim), lambda b, h, j: (b, 0, 0, 0)),
          pl.BlockSpec((None, num_heads, seq_q), lambda b, h, j: (b, 0, 0)),
          pl.BlockSpec((None, num_heads, seq_q), lambda b, h, j: (b, 0, 0)),
          pl.BlockSpec((None, block_k_dkv, None, head_dim), lambda b, h, j: (b, j, h, 0)),
          pl.BlockSpec((None, block_k_dkv, None, head_dim), lambda b, h, j: (b, j, h, 0)),
          pl.BlockSpec((None, block_k_dkv), lambda b, h, j: (b, j)),
      ],
      out_specs=[pl.BlockSpec((None, block_k_dkv, None, head_dim), lambda b, h, j: (b, j, h, 0))] * 2,
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      compiler_params=plgpu.CompilerParams(num_warps=_num_warps(block_q_dkv, block_k_dkv, head_dim),
                                           num_stages=2),
      interpret=interpret_arg(interpret),
      name="d2f_flash_backward_dkv",
  )(q, q_ids, do, lse, delta, k, v, k_ids)
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, block_k=block_k_dq, **common),
      grid=(batch, num_heads, seq_q // block_q_dq),
      in_specs=[
          pl.BlockSpec((None, block_q_dq, None, head_dim), lambda b, h, i: (b, i, h, 0)),
          pl.BlockSpec((None, block_q_dq), lambda b, h, i: (b, i)),
          pl.BlockSpec((None, block_q_dq, None, head_dim), lambda b, h, i: (b, i, h, 0)),
          pl.BlockSpec((None, None, block_q_dq), lambda b, h, i: (b, h, i)),
          pl.BlockSpec((None, None, block_q_dq), lambda b, h, i: (b, h, i)),
          pl.BlockSpec((None, seq_k, None, head_dim), lambda b, h, i: (b, 0, lax.div(h, group), 0)),
          pl.BlockSpec((None, seq_k, None, head_dim), lambda b, h, i: (b, 0, lax.div(h, group), 0)),
          pl.BlockSpec((None, seq_k), lambda b, h, i: (b, 0)),
      ],
      out_specs=pl.BlockSpec((None, block_q_dq, None, head_dim), lambda b, h, i: (b, i, h, 0)),
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      compiler_params=plgpu.CompilerParams(num_warps=_num_warps(block_q_dq, block_k_dq, head_dim), num_stages=2),
      interpret=interpret_arg(interpret),
      name="d2f_flash_backward_dq",
  )(q, q_ids, do, lse, delta, k, v, k_ids)
  return dq, dk, dv
