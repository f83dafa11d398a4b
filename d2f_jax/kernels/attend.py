"""The model-facing entry points: one string, `ModelConfig.attention_impl`, picks the implementation.

"xla" is exactly the model's original math (`attention_reference` on the concatenated keys). "auto" (the
default) uses the Pallas kernels on GPU/TPU and is exactly "xla" on CPU; "pallas" insists on the kernels.
"interpret_gpu" and "interpret_tpu" run the kernels in that backend's CPU interpreter: slow, for tests.
Being part of the static config, the choice is part of every jit cache key, so switching it never reuses
a stale trace. "auto" resolves when traced: for the platform of the active `MeshLayout`'s devices (a
compile-only TPU mesh on a CPU host gets Mosaic), else for the default backend.

Under a layout with more than one device every kernel call runs inside `jax.shard_map` (kernels/sharded.py):
XLA cannot partition a Pallas call. The reference needs none: XLA partitions it like any other einsum.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from d2f_jax.kernels.common import ATTENTION_IMPLS, PAD_ID, resolve_backend
from d2f_jax.kernels.flash_attention import flash_attention
from d2f_jax.kernels.sharded import KV, QUERY, ROWS, SCALAR, STACKED_KV, plan_heads, sharded_kernel_call
from d2f_jax.kernels.window_attention import window_attention, window_attention_reference
from d2f_jax.kernels.reference import attention_reference
from d2f_jax.sharding.layout import MeshLayout, current_layout


def _kernel_options(impl: str) -> tuple[str, str | bool]:
  """attention_impl -> (impl, interpret) of the kernel wrappers."""
  if impl not in ATTENTION_IMPLS:
    raise ValueError(f"attention impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
  if impl.startswith("interpret_"):
    return "pallas", impl.removeprefix("interpret_")
  return impl, False


def layout_platform(layout: MeshLayout | None) -> str | None:
  """The platform of a concrete layout mesh's devices (None without a layout or for an AbstractMesh)."""
  if layout is None or not isinstance(layout.mesh, jax.sharding.Mesh):
    return None
  return layout.mesh.devices.flat[0].platform


def resolve(impl: str, layout: MeshLayout | None = None) -> tuple[str, str | bool, str | None]:
  """attention_impl -> (backend "xla" | "gpu" | "tpu", interpret, platform) for this trace."""
  kernel_impl, interpret = _kernel_options(impl)
  platform = layout_platform(layout)
  return resolve_backend(kernel_impl, interpret, platform), interpret, platform


def visible_length(cache_ids: jax.Array) -> jax.Array:
  """[B] one past the last cache slot whose id is not PAD_ID: no query but a padding one sees beyond it.

  Equal to `KVCache.length` or smaller (when the last written slots are padding), so it is a valid bound
  for the window kernel when only the ids are at hand.
  """
  slots = jnp.arange(1, cache_ids.shape[1] + 1, dtype=jnp.int32)[None, :]
  return jnp.max(jnp.where(cache_ids != PAD_ID, slots, 0), axis=1)


def attend(q, k, v, q_ids, k_ids, *, impl: str = "auto"):
  """Full-sequence attention (training, no-cache inference). q: [B, T, H, D]; k, v: [B, S, K, D]."""
  layout = current_layout()
  backend, interpret, platform = resolve(impl, layout)
  if backend == "xla":
    return attention_reference(q, k, v, q_ids, k_ids)
  kernel = lambda q, k, v, q_ids, k_ids: flash_attention(q, k, v, q_ids, k_ids, impl="pallas",
                                                          interpret=interpret, platform=platform)
  return sharded_kernel_call(kernel, layout, (q, k, v, q_ids, k_ids), (QUERY, KV, KV, ROWS, ROWS))


def attend_window(q, k_win, v_win, q_ids, win_ids, cache_k, cache_v, cache_ids, cache_len=None, *,
                  layer: int | jax.Array | None = None, impl: str = "auto"):
  """A decoding window against the KV cache plus itself. q: [B, Tw, H, D]; k_win, v_win: [B, Tw, K, D];
  cache_k, cache_v: [B, S, K, D], or the stacked [L, B, S, K, D] read at `layer`: a static int (the kernels
  read it in place; a slice would be copied for the call) or a traced int32 scalar, a layer loop's counter
  (read in place by the TPU kernel; sliced out, i.e. copied, for the GPU one); cache_ids: [B, S]; cache_len:
  [B] (None: derived from cache_ids).

  "xla" concatenates and runs the reference, exactly as the model always did. The kernels never read
  slots at or past cache_len; outputs of padding queries (id PAD_ID) are unspecified there.
  """
  layout = current_layout()
  backend, interpret, platform = resolve(impl, layout)
  if layer is not None and (backend == "xla" or cache_k.dtype != q.dtype
                            or not _reads_stack_in_place(layout, q, k_win)):
    cache_k, cache_v, layer = cache_k[layer], cache_v[layer], None  # converting the stack would copy it all
  if cache_k.dtype != q.dtype:  # a cache kept in another dtype (a copy; keep it in the compute dtype)
    cache_k, cache_v = cache_k.astype(q.dtype), cache_v.astype(q.dtype)
  if backend == "xla":
    if cache_len is None:
      keys = jnp.concatenate([cache_k, k_win], axis=1)  # [B, S + Tw, K, D]
      values = jnp.concatenate([cache_v, v_win], axis=1)
      return attention_reference(q, keys, values, q_ids, jnp.concatenate([cache_ids, win_ids], axis=1))
    return window_attention_reference(q, k_win, v_win, q_ids, win_ids, cache_k, cache_v, cache_ids, cache_len)
  if cache_len is None:
    cache_len = visible_length(cache_ids)

  args = (q, k_win, v_win, q_ids, win_ids, cache_k, cache_v, cache_ids, cache_len)
  kinds = (QUERY, KV, KV, ROWS, ROWS) + ((KV, KV) if layer is None else (STACKED_KV, STACKED_KV)) + (ROWS, ROWS)
  if layer is None or isinstance(layer, int):
    def kernel(*a):
      return window_attention(*a, layer=layer, impl="pallas", interpret=interpret, platform=platform)
  else:  # a traced layer travels into the shard_map as a replicated argument
    args, kinds = args + (jnp.asarray(layer, jnp.int32),), kinds + (SCALAR,)

    def kernel(*a):
      return window_attention(*a[:-1], layer_index=a[-1], impl="pallas", interpret=interpret, platform=platform)
  return sharded_kernel_call(kernel, layout, args, kinds)


def _reads_stack_in_place(layout: MeshLayout | None, q, k_win) -> bool:
  """Whether the kernel call can take the stacked cache whole: not when each head shard must gather its kv
  heads first (kernels/sharded.py), which would copy every layer's cache rather than one."""
  if layout is None or layout.num_devices == 1:
    return True
  return plan_heads(q.shape[2], k_win.shape[2], layout.head_size()).kv_split
