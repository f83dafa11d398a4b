"""Pieces every attention kernel shares: backend dispatch, argument checks, padding, the online-softmax step.

The kernels implement one rule (see `d2f_jax.kernels.reference`): key j is visible to query i iff
`k_ids[j] <= q_ids[i]`. The step functions below work on values, so the Triton and the Mosaic kernels use
the same arithmetic and differ only in how tiles reach them.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import tpu as pltpu

# MASK_VALUE: the reference's finite mask value; a masked score contributes exp(-1e30 - m) == 0
from d2f_jax.kernels.reference import MASK_VALUE, PAD_ID  # noqa: F401  (re-exported)

MIN_ID = jnp.iinfo(jnp.int32).min  # sees no key; used to keep padded query rows out of tile statistics

IMPLS = ("auto", "xla", "pallas")
# ModelConfig.attention_impl: a kernel impl, or a backend's kernel in its CPU interpreter (tests)
ATTENTION_IMPLS: tuple[str, ...] = ("xla", "auto", "pallas", "interpret_gpu", "interpret_tpu")
INTERPRETS = (False, "gpu", "tpu")


def _platform() -> str:
  """The default backend's platform (a seam for tests that lower kernels for a device they lack)."""
  return jax.default_backend()


def resolve_backend(impl: str, interpret, platform: str | None = None) -> str:
  """Which code runs: "xla" (the jnp reference), "gpu" (Triton) or "tpu" (Mosaic).

  impl "auto" picks Pallas on GPU/TPU and the reference on CPU; "pallas" insists on a kernel; `interpret`
  ("gpu" | "tpu") runs that backend's kernel in its CPU interpreter, so it implies a kernel unless impl="xla".
  platform: the device platform the call is compiled for ("cpu", "gpu", "cuda", "rocm", "tpu"); default
  the default backend's (a compile-only TPU mesh on a CPU host passes "tpu").
  """
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
  if interpret is None:
    interpret = False
  if interpret not in INTERPRETS:
    raise ValueError(f"interpret must be one of {INTERPRETS}, got {interpret!r}")
  if impl == "xla":
    return "xla"
  if interpret:
    return interpret
  platform = _platform() if platform is None else platform
  if platform in ("gpu", "cuda", "rocm"):
    return "gpu"
  if platform == "tpu":
    return "tpu"
  if impl == "pallas":
    raise ValueError(f"impl='pallas' needs a GPU or TPU backend (this is {platform!r}); "
                     "pass interpret='gpu' or 'tpu' to run a kernel in the interpreter")
  return "xla"


def interpret_arg(interpret):
  """The value `pl.pallas_call(interpret=...)` takes for our `interpret` option."""
  if interpret == "tpu":
    return pltpu.InterpretParams()
  return interpret == "gpu"


def matmul_precision(dtype):
  """Full fp32 products for fp32 inputs (the reference's numerics); the MXU/tensor-core default otherwise."""
  return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def matmul(a, b, *, trans_a=False, trans_b=False, precision=None):
  """2-D product with fp32 accumulation; the transposes fold into the contraction."""
  dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
  return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def online_softmax_step(m_prev, l_prev, acc_prev, s, v, precision):
  """One FlashAttention-2 update with a tile of masked scores.

  s: [R, C] fp32 (masked entries MASK_VALUE); v: [C, D]; m, l: [R, 1] running max / sum; acc: [R, D] fp32.
  Probabilities are cast to v's dtype before the product, as the reference does.
  """
  m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
  alpha = jnp.exp(m_prev - m_next)
  p = jnp.exp(s - m_next)  # [R, C]
  l_next = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
  acc_next = alpha * acc_prev + matmul(p.astype(v.dtype), v, precision=precision)
  return m_next, l_next, acc_next


def finalize(l, acc):
  """acc / l, guarding rows that saw no key at all (never the case for a query that sees itself)."""
  return acc / jnp.where(l == 0.0, 1.0, l)


def log_sum_exp(m, l):
  """The backward's residual. A row that saw no key (a padding row whose tiles were all skipped) gets
  +inf, so the backward recomputes probabilities exp(s - lse) == 0 for it instead of inf * 0."""
  return jnp.where(l == 0.0, jnp.inf, m + jnp.log(l))


# --- shapes ----------------------------------------------------------------------------------------

def round_up(x: int, multiple: int) -> int:
  return -(-x // multiple) * multiple


def next_pow2(x: int) -> int:
  return 1 << max(0, (x - 1).bit_length())


def pad_axis(x: jax.Array, axis: int, size: int, value=0) -> jax.Array:
  """Pad `x` along `axis` up to `size` with `value` (no-op when already that long)."""
  extra = size - x.shape[axis]
  if extra == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths, constant_values=value)


def padded_length(length: int, *blocks: int) -> int:
  """Smallest length >= `length` that every block size divides."""
  return round_up(length, math.lcm(*blocks))


def tile_max_ids(ids: jax.Array, block: int, valid_len: int) -> jax.Array:
  """Per-tile max of query ids [B, n], ignoring rows past `valid_len` (padding added by the wrapper)."""
  rows = jnp.arange(ids.shape[1])[None, :]
  ids = jnp.where(rows < valid_len, ids, MIN_ID)
  return ids.reshape(ids.shape[0], -1, block).max(axis=-1)


def tile_min_ids(ids: jax.Array, block: int) -> jax.Array:
  """Per-tile min of key ids [B, n]: a key tile is invisible to a query tile iff min(k) > max(q)."""
  return ids.reshape(ids.shape[0], -1, block).min(axis=-1)


def check_array(name: str, x, shape: tuple, dtype=None) -> None:
  """Raise a ValueError naming the argument when `x` does not have `shape` (None entries: any size)."""
  got = tuple(getattr(x, "shape", ()))
  if len(got) != len(shape) or any(e is not None and e != g for e, g in zip(shape, got)):
    want = "[" + ", ".join("?" if e is None else str(e) for e in shape) + "]"
    raise ValueError(f"{name} must have shape {want}, got {list(got)}")
  if dtype is not None and jnp.dtype(x.dtype) != jnp.dtype(dtype):
    raise ValueError(f"{name} must have dtype {jnp.dtype(dtype).name}, got {jnp.dtype(x.dtype).name}")


def check_float(name: str, x, dtype) -> None:
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"{name} must be floating point, got {jnp.dtype(x.dtype).name}")
  if jnp.dtype(x.dtype) != jnp.dtype(dtype):
    raise ValueError(f"{name} must have q's dtype {jnp.dtype(dtype).name}, got {jnp.dtype(x.dtype).name}")


def check_gqa(num_heads: int, num_kv_heads: int) -> int:
  if num_kv_heads <= 0 or num_heads % num_kv_heads:
    raise ValueError(f"query heads ({num_heads}) must be a multiple of kv heads ({num_kv_heads})")
  return num_heads // num_kv_heads


__all__ = ["PAD_ID", "MASK_VALUE", "MIN_ID", "IMPLS", "ATTENTION_IMPLS", "INTERPRETS", "resolve_backend",
           "interpret_arg", "matmul", "matmul_precision", "online_softmax_step", "finalize", "log_sum_exp", "round_up", "next_pow2",
           "pad_axis", "padded_length", "tile_max_ids", "tile_min_ids", "check_array", "check_float",
           "check_gqa"]
