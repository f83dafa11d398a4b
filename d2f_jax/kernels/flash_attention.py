"""Flash attention over full sequences under the id rule (training and no-cache inference), with a
kernel backward pass.

One rule covers every pattern the project trains with: key j visible to query i iff k_ids[j] <= q_ids[i]
(prompt-visible block-causal, bidirectional, causal, padding). The reference is
`d2f_jax.kernels.reference.attention_reference`; the kernels agree with it on every row, padding rows
included. Whole key tiles invisible to a whole query tile (min key id > max query id) are skipped, which
for block-causal attention removes about half the work.

The backward pass is a `jax.custom_vjp` whose residual is the forward's log-sum-exp: dK/dV and dQ are two
kernels that recompute the probabilities tile by tile, so memory stays linear in the sequence length.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from d2f_jax.kernels.block_sizes import BlockSizes, fit_block
from d2f_jax.kernels.common import (PAD_ID, check_array, check_float, check_gqa, matmul_precision, pad_axis,
                                    padded_length, resolve_backend)
from d2f_jax.kernels.flash_attention_gpu import backward_gpu, forward_gpu
from d2f_jax.kernels.flash_attention_tpu import backward_tpu, forward_tpu
from d2f_jax.kernels.reference import attention_reference

flash_attention_reference = attention_reference


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Everything static about one call: backend, tiles (already fitted to the padded lengths), true lengths."""

  backend: str
  interpret: str | bool
  scale: float
  block_q: int
  block_k: int
  block_q_dkv: int
  block_k_dkv: int
  block_q_dq: int
  block_k_dq: int
  q_len: int
  kv_len: int
  precision: object = None


def _forward(plan: _Plan, q, k, v, q_ids, k_ids):
  fn = forward_gpu if plan.backend == "gpu" else forward_tpu
  return fn(q, k, v, q_ids, k_ids, scale=plan.scale, block_q=plan.block_q, block_k=plan.block_k,
            q_len=plan.q_len, kv_len=plan.kv_len, interpret=plan.interpret, precision=plan.precision)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(plan: _Plan, q, k, v, q_ids, k_ids):
  return _forward(plan, q, k, v, q_ids, k_ids)[0]


def _flash_fwd(plan, q, k, v, q_ids, k_ids):
  o, lse = _forward(plan, q, k, v, q_ids, k_ids)
  return o, (q, k, v, q_ids, k_ids, o, lse)


def _flash_bwd(plan, residuals, do):
  q, k, v, q_ids, k_ids, o, lse = residuals
  delta = jnp.einsum("bthd,bthd->bht", o.astype(jnp.float32), do.astype(jnp.float32))  # [B, H, T]
  fn = backward_gpu if plan.backend == "gpu" else backward_tpu
  dq, dk, dv = fn(q, k, v, q_ids, k_ids, do.astype(q.dtype), lse, delta, scale=plan.scale,
                  block_q_dkv=plan.block_q_dkv, block_k_dkv=plan.block_k_dkv, block_q_dq=plan.block_q_dq,
                  block_k_dq=plan.block_k_dq, q_len=plan.q_len, kv_len=plan.kv_len, interpret=plan.interpret,
                  precision=plan.precision)
  return dq, dk, dv, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _check_args(q, k, v, q_ids, k_ids):
  if getattr(q, "ndim", None) != 4:
    raise ValueError(f"q must have shape [B, T, H, D], got {list(getattr(q, 'shape', ()))}")
  batch, seq_q, num_heads, head_dim = q.shape
  if getattr(k, "ndim", None) != 4:
    raise ValueError(f"k must have shape [B, S, K, D], got {list(getattr(k, 'shape', ()))}")
  seq_k, num_kv_heads = k.shape[1:3]
  check_gqa(num_heads, num_kv_heads)
  check_array("k", k, (batch, seq_k, num_kv_heads, head_dim))
  check_array("v", v, (batch, seq_k, num_kv_heads, head_dim))
  check_array("q_ids", q_ids, (batch, seq_q), jnp.int32)
  check_array("k_ids", k_ids, (batch, seq_k), jnp.int32)
  check_float("q", q, q.dtype)
  check_float("k", k, q.dtype)
  check_float("v", v, q.dtype)


def _plan(q, k, backend, interpret, scale, block_sizes) -> _Plan:
  seq_q, _, head_dim = q.shape[1:]
  seq_k = k.shape[1]
  if backend == "gpu" and (head_dim < 16 or head_dim & (head_dim - 1)):
    raise ValueError(f"the GPU (Triton) kernels need head_dim a power of two >= 16, got {head_dim}")
  sizes = (block_sizes or BlockSizes.get_default(backend, "flash")).validate(backend)
  # Every query tile is fitted on the 128 grid on TPU: the dK/dV query tile is a lane dimension there (of
  # the transposed probabilities), and tiles that divide each other keep the padding small.
  fit = lambda block, length: fit_block(block, length, backend, "k")
  return _Plan(
      backend=backend, interpret=interpret or False, scale=head_dim ** -0.5 if scale is None else float(scale),
      block_q=fit(sizes.block_q, seq_q), block_k=fit(sizes.block_k, seq_k),
      block_q_dkv=fit(sizes.block_q_dkv, seq_q), block_k_dkv=fit(sizes.block_k_dkv, seq_k),
      block_q_dq=fit(sizes.block_q_dq, seq_q), block_k_dq=fit(sizes.block_k_dq, seq_k),
      q_len=seq_q, kv_len=seq_k, precision=matmul_precision(q.dtype))


@functools.partial(jax.jit, static_argnames=("scale", "impl", "interpret", "block_sizes", "platform"))
def flash_attention(q, k, v, q_ids, k_ids, *, scale: float | None = None, impl: str = "auto", interpret=False,
                    block_sizes: BlockSizes | None = None, platform: str | None = None):
  """Softmax attention under the id rule, grouped-query, differentiable in q, k, v.

  q: [B, T, H, D]; k, v: [B, S, K, D] with H a multiple of K (query head h uses kv head h // (H // K));
  q_ids: [B, T], k_ids: [B, S] int32. scale defaults to D ** -0.5.
  impl: "auto" (Pallas on GPU/TPU, reference on CPU) | "xla" | "pallas"; interpret: False | "gpu" | "tpu";
  platform: the device platform to dispatch for (default: the default backend's).
  Returns [B, T, H, D] in q's dtype. Lengths need not be multiples of the tiles (padded here).
  """
  _check_args(q, k, v, q_ids, k_ids)
  backend = resolve_backend(impl, interpret, platform)
  if backend == "xla":
    return attention_reference(q, k, v, q_ids, k_ids, scale=scale)
  plan = _plan(q, k, backend, interpret, scale, block_sizes)
  seq_q, seq_k = q.shape[1], k.shape[1]
  padded_q = padded_length(seq_q, plan.block_q, plan.block_q_dkv, plan.block_q_dq)
  padded_k = padded_length(seq_k, plan.block_k, plan.block_k_dkv, plan.block_k_dq)
  q = pad_axis(q, 1, padded_q)
  q_ids = pad_axis(q_ids, 1, padded_q, PAD_ID)
  k, v = pad_axis(k, 1, padded_k), pad_axis(v, 1, padded_k)
  k_ids = pad_axis(k_ids, 1, padded_k, PAD_ID)
  return _flash(plan, q, k, v, q_ids, k_ids)[:, :seq_q]
