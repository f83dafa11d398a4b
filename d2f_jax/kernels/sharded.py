"""Kernel calls under a mesh: `jax.shard_map` over the active layout's batch and head axes.

XLA cannot partition a Mosaic or Triton custom call ("Mosaic kernels cannot be automatically partitioned"),
so under a `MeshLayout` with more than one device every kernel call runs per shard: rows [B] over the
layout's batch axes, query heads [H] over its head axis, all other mesh axes replicated. Attention is
independent per row and per head, so the shards compute exactly the unsharded result.

Grouped-query heads (query head h reads kv head h // G, G = H / K) with n head shards:
- H % n != 0: heads stay replicated on that axis (every shard computes all heads; slower, never wrong);
- K % n == 0: kv heads split with the query heads (shard i holds query heads [iH/n, (i+1)H/n) and exactly
  the kv heads they read);
- otherwise (e.g. Dream's 4 kv heads on tensor 8): K/V enter replicated on the head axis, which is how the
  'kv_heads' rule leaves them, and each shard takes the K * r / n kv heads its queries read, r the smallest
  divisor of G with n | K * r (each kv head repeated r times, split n ways, so the local group is G / r).
  Only those heads are copied, never the whole cache repeated.
Batch sizes the batch axes do not divide fall back to replication on those axes (`MeshLayout.batch_split`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from d2f_jax.sharding.layout import MeshLayout

# Argument kinds: how each kernel argument is laid out.
QUERY = "query"  # [B, T, H, D]: batch, -, query heads, -
KV = "kv"  # [B, S, K, D]: batch, -, kv heads, -
ROWS = "rows"  # [B, ...]: batch only (ids, lengths)
STACKED_KV = "stacked_kv"  # [L, B, S, K, D]: the whole stacked cache, one layer of it read (kv_split only)
SCALAR = "scalar"  # []: the same on every shard (a layer loop's counter)


@dataclasses.dataclass(frozen=True)
class HeadSplit:
  """How H query heads / K kv heads split over `shards` head shards (1: heads replicated)."""

  shards: int
  kv_split: bool  # kv heads split like the query heads (K % shards == 0)
  kv_local: int  # kv heads each shard works with
  repeat: int  # r: each kv head counted r times before the split (1 when kv_split)

  def local_kv_heads(self, shard: jax.Array) -> jax.Array:
    """[kv_local] indices into the full K kv heads that shard `shard` reads (not kv_split only)."""
    return (shard * self.kv_local + jnp.arange(self.kv_local)) // self.repeat


def plan_heads(num_heads: int, num_kv_heads: int, shards: int) -> HeadSplit:
  """The head split for `shards` head shards (see the module docstring)."""
  if num_heads % num_kv_heads:
    raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
  if shards <= 1 or num_heads % shards:
    return HeadSplit(shards=1, kv_split=True, kv_local=num_kv_heads, repeat=1)
  if num_kv_heads % shards == 0:
    return HeadSplit(shards=shards, kv_split=True, kv_local=num_kv_heads // shards, repeat=1)
  group = num_heads // num_kv_heads
  # r = group always qualifies (K * G = H, a multiple of shards); take the smallest.
  repeat = next(r for r in range(1, group + 1) if group % r == 0 and (num_kv_heads * r) % shards == 0)
  return HeadSplit(shards=shards, kv_split=False, kv_local=num_kv_heads * repeat // shards, repeat=repeat)


def sharded_kernel_call(kernel: Callable, layout: MeshLayout | None, args: Sequence[jax.Array],
                        kinds: Sequence[str]) -> jax.Array:
  """kernel(*args) -> [B, T, H, D], per shard of `layout` (directly without one, or on one device).

  kinds names each argument's layout (QUERY, KV, ROWS); the first QUERY and KV arguments give B, H, K.
  """
  if layout is None or layout.num_devices == 1:
    return kernel(*args)
  query = args[kinds.index(QUERY)]
  kv = args[kinds.index(KV)]
  batch, _, num_heads, _ = query.shape
  batch_axes = layout.batch_split(batch)
  split = plan_heads(num_heads, kv.shape[2], layout.head_size())
  rows = batch_axes or None
  heads = layout.head_axis if split.shards > 1 else None
  kv_heads = heads if split.kv_split else None

  def spec(kind: str, ndim: int) -> P:
    if kind == QUERY:
      return P(rows, None, heads, None)
    if kind == KV:
      return P(rows, None, kv_heads, None)
    if kind == STACKED_KV:
      if not split.kv_split:
        raise ValueError("a stacked KV cache needs the kv heads split with the query heads; slice its layer out")
      return P(None, rows, None, kv_heads, None)
    if kind == ROWS:
      return P(rows, *([None] * (ndim - 1)))
    if kind == SCALAR:
      return P()
    raise ValueError(f"unknown kernel argument kind {kind!r}")

  def per_shard(*local):
    if not split.kv_split:  # full K/V here: keep the kv heads this shard's query heads read
      index = split.local_kv_heads(jax.lax.axis_index(layout.head_axis))
      local = [jnp.take(x, index, axis=2) if kind == KV else x for x, kind in zip(local, kinds)]
    return kernel(*local)

  in_specs = tuple(spec(kind, x.ndim) for x, kind in zip(args, kinds))
  return jax.shard_map(per_shard, mesh=layout.mesh, in_specs=in_specs, out_specs=spec(QUERY, 4),
                       check_vma=False)(*args)
