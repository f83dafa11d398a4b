"""Static-size per-layer KV cache for incremental (windowed) decoding.

Fixed shapes keep the decode loop a single compiled program: rows fill at their own speed, tracked by
`length`, and every slot carries the attention id it was written with (PAD_ID when empty), so the
attention rule needs no separate validity mask.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from d2f_jax.kernels import visible_length
from d2f_jax.models.attention import PAD_ID
from d2f_jax.models.config import ModelConfig
from d2f_jax.sharding.layout import MeshLayout, current_layout


@flax.struct.dataclass
class KVCache:
  k: jax.Array  # [L, B, S, K, D]
  v: jax.Array  # [L, B, S, K, D]
  ids: jax.Array  # [B, S] int32 attention ids of the cached tokens, PAD_ID for empty slots
  length: jax.Array  # [B] int32, slots [0, length) are written

  @classmethod
  def init(cls, config: ModelConfig, batch: int, max_len: int, dtype=None) -> "KVCache":
    shape = (config.num_layers, batch, max_len, config.num_kv_heads, config.head_dim)
    dtype = config.compute_dtype if dtype is None else dtype
    cache = cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                ids=jnp.full((batch, max_len), PAD_ID, jnp.int32), length=jnp.zeros((batch,), jnp.int32))
    return cache.constrain(current_layout())

  def constrain(self, layout: MeshLayout | None) -> "KVCache":
    """Pin the cache to `layout` (a no-op without one), as `cache_specs` lays it out."""
    if layout is None or layout.num_devices == 1:
      return self
    specs = cache_specs(layout, self.ids.shape[0], self.k.shape[3])
    pin = lambda x, spec: jax.lax.with_sharding_constraint(x, NamedSharding(layout.mesh, spec))
    return jax.tree.map(pin, self, specs)

  @property
  def max_len(self) -> int:
    return self.ids.shape[1]

  def write(self, k_new: jax.Array, v_new: jax.Array, ids_new: jax.Array, count: jax.Array) -> "KVCache":
    """Append the first `count[b]` window tokens of each row at slot `length[b]`.

    k_new, v_new: [L, B, T, K, D]; ids_new: [B, T]; count: [B] int32 in [0, T].
    Slots past the capacity are dropped rather than wrapped (the caller sizes the cache).
    """
    window = ids_new.shape[1]
    offsets = jnp.arange(window, dtype=jnp.int32)
    slots = self.length[:, None] + offsets[None, :]  # [B, T]
    slots = jnp.where(offsets[None, :] < count[:, None], slots, self.max_len)  # out of range -> dropped
    rows = jnp.arange(slots.shape[0])[:, None]
    k = self.k.at[:, rows, slots].set(k_new.astype(self.k.dtype), mode="drop")
    v = self.v.at[:, rows, slots].set(v_new.astype(self.v.dtype), mode="drop")
    ids = self.ids.at[rows, slots].set(ids_new, mode="drop")
    length = jnp.minimum(self.length + count, self.max_len)
    return self.replace(k=k, v=v, ids=ids, length=length)

  def put(self, k_new: jax.Array, v_new: jax.Array, ids_new: jax.Array, slots: jax.Array) -> "KVCache":
    """Write window token t of each row at slot `slots[b, t]` (>= max_len: not written), `length` unchanged:
    K/V kept past the appended prefix (the decoder's approximate cache of decided positions in flight),
    later overwritten by `write` when their block is appended exactly.

    k_new, v_new: [L, B, T, K, D]; ids_new, slots: [B, T].
    """
    rows = jnp.arange(slots.shape[0])[:, None]
    slots = jnp.where(slots < self.max_len, slots, self.max_len)
    return self.replace(k=self.k.at[:, rows, slots].set(k_new.astype(self.k.dtype), mode="drop"),
                        v=self.v.at[:, rows, slots].set(v_new.astype(self.v.dtype), mode="drop"),
                        ids=self.ids.at[rows, slots].set(ids_new, mode="drop"))

  def hide(self, slots: jax.Array) -> "KVCache":
    """This cache as a forward that re-feeds `slots` [B, T] (>= max_len: none) must see it: those slots
    invisible (PAD_ID), and `length` extended over every visible slot, so the attention kernels, which read
    slots below `length` only, reach K/V kept past the appended prefix (`put`)."""
    rows = jnp.arange(slots.shape[0])[:, None]
    ids = self.ids.at[rows, jnp.where(slots < self.max_len, slots, self.max_len)].set(PAD_ID, mode="drop")
    return self.replace(ids=ids, length=visible_length(ids).astype(jnp.int32))


def cache_specs(layout: MeshLayout, batch: int, num_kv_heads: int) -> KVCache:
  """The cache's partition specs under `layout` (a KVCache of PartitionSpecs): rows over its batch axes, kv
  heads over its head axis when that divides them (else replicated across it, e.g. Dream-7B's 4 kv heads on
  tensor 8)."""
  rows = layout.batch_split(batch) or None
  heads = layout.head_axis if num_kv_heads % layout.head_size() == 0 else None
  kv = P(None, rows, None, heads, None)  # [L, B, S, K, D]
  return KVCache(k=kv, v=kv, ids=P(rows, None), length=P(rows))
