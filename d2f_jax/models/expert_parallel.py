"""Expert parallelism: the routed experts of a MoE layer split whole over one mesh axis, run in `jax.shard_map`.

Each shard of the expert axis holds X / S experts ([X / S, E, F] of each projection) and computes only the
(token, expert) pairs routed to them, as one grouped matmul (`lax.ragged_dot`) over its pairs sorted by
local expert. How pairs reach their shard depends on how the tokens are split:
- tokens replicated along the expert axis (the expert axis is not one the batch splits over, e.g. experts
  on `tensor`, rows on `data x fsdp`): every shard already has every pair; each computes its own experts'
  pairs and a `psum` over the axis adds the shards' parts (the all-reduce a tensor-parallel MLP also pays);
- tokens split along the expert axis (experts on a batch axis): each shard sends each pair to the shard
  holding its expert with one `all_to_all` and takes the outputs back with a second. The exchange is
  dropless: a shard's buffer for each destination has room for all of its pairs (S x the pairs in memory and
  traffic), so no pair is ever dropped and the output equals the unsharded one; a capacity factor would
  shrink the buffers but drop pairs, which changes outputs, so none is offered.

Without an active layout, on one device, or where the axis does not divide the experts, `sharded_experts`
returns None and the caller computes the experts as on one device (models/moe.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from d2f_jax.sharding.layout import MeshLayout, current_layout

EXPERT_WEIGHTS = ("expert_gate", "expert_up", "expert_down")


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
  return jax.nn.silu(gate) * up


def local_experts(rows: jax.Array, ids: jax.Array, w: dict, first: jax.Array) -> jax.Array:
  """Outputs [M, E] float32 of pair rows [M, E] through their experts `ids` [M] (global ids; -1: no pair),
  for the pairs whose expert is one of this shard's [first, first + X_local); zero for the others."""
  dtype = rows.dtype
  count = w["expert_gate"].shape[0]  # X_local
  local = ids - first  # [M]
  mine = (ids >= 0) & (local >= 0) & (local < count)
  key = jnp.where(mine, local, count)  # pairs of other shards sort last
  order = jnp.argsort(key, stable=True)
  group_sizes = jnp.zeros((count,), jnp.int32).at[key].add(1, mode="drop")  # [X_local]
  sorted_rows = rows[order]  # [M, E]
  gate = jax.lax.ragged_dot(sorted_rows, w["expert_gate"].astype(dtype), group_sizes)  # [M, F]
  up = jax.lax.ragged_dot(sorted_rows, w["expert_up"].astype(dtype), group_sizes)
  out = jax.lax.ragged_dot(swiglu(gate, up), w["expert_down"].astype(dtype), group_sizes)  # [M, E]
  unsorted = jnp.zeros(out.shape, jnp.float32).at[order].set(out.astype(jnp.float32))
  return jnp.where(mine[:, None], unsorted, 0.0)


def _replicated_tokens(h, experts, weights, w, axis: str):
  """Per shard: every local pair is here; compute this shard's experts' share, add the shards' shares."""
  n, k = experts.shape
  first = jax.lax.axis_index(axis) * w["expert_gate"].shape[0]
  rows = jnp.repeat(h, k, axis=0)  # [N * k, E]: pair p = (token p // k, choice p % k)
  out = local_experts(rows, experts.reshape(-1), w, first).reshape(n, k, -1)  # [N, k, E]
  return jax.lax.psum(jnp.einsum("nke,nk->ne", out, weights), axis)


def _split_tokens(h, experts, weights, w, axis: str, shards: int):
  """Per shard: send each pair to its expert's shard (all_to_all), compute, send the outputs back."""
  n, k = experts.shape
  count = w["expert_gate"].shape[0]
  ids = experts.reshape(-1)  # [C], C = N * k
  dest = ids // count  # [C]: the shard holding each pair's expert
  to = jnp.arange(shards)[:, None] == dest[None, :]  # [S, C]
  rows = jnp.repeat(h, k, axis=0)  # [C, E]
  send = jnp.where(to[:, :, None], rows[None], jnp.zeros((), h.dtype))  # [S, C, E]
  send_ids = jnp.where(to, ids[None], -1)  # [S, C]
  recv = jax.lax.all_to_all(send, axis, 0, 0, tiled=True)  # [S, C, E]: row s from source shard s
  recv_ids = jax.lax.all_to_all(send_ids, axis, 0, 0, tiled=True)
  first = jax.lax.axis_index(axis) * count
  done = local_experts(recv.reshape(-1, h.shape[-1]), recv_ids.reshape(-1), w, first)  # [S * C, E]
  back = jax.lax.all_to_all(done.reshape(recv.shape), axis, 0, 0, tiled=True)  # [S, C, E]: row d from shard d
  out = back.sum(axis=0).reshape(n, k, -1)  # each pair came back from one shard, zeros from the rest
  return jnp.einsum("nke,nk->ne", out, weights)


def expert_axis(layout: MeshLayout | None, num_experts: int) -> str | None:
  """The mesh axis the experts split over under `layout`, if any and if its size divides them."""
  if layout is None or layout.expert_axis is None:
    return None
  size = layout.mesh.shape[layout.expert_axis]
  return layout.expert_axis if size > 1 and num_experts % size == 0 else None


def sharded_experts(h: jax.Array, w: dict, experts: jax.Array, weights: jax.Array) -> jax.Array | None:
  """sum_k weight_k * expert_k(h) [B, T, E] float32 for h [B, T, E], experts / weights [B, T, k], computed
  expert-parallel under the active layout; None where no expert axis applies (see the module docstring)."""
  layout = current_layout()
  axis = expert_axis(layout, w["expert_gate"].shape[0])
  if axis is None:
    return None
  batch, length, embed = h.shape
  split = layout.batch_split(batch)
  rows = P(split or None, None, None)
  shards = layout.mesh.shape[axis]

  def per_shard(h, experts, weights, gate, up, down):
    local = {"expert_gate": gate, "expert_up": up, "expert_down": down}
    n = h.shape[0] * h.shape[1]
    args = (h.reshape(n, embed), experts.reshape(n, -1), weights.reshape(n, -1), local)
    out = _split_tokens(*args, axis, shards) if axis in split else _replicated_tokens(*args, axis)
    return out.reshape(h.shape)

  expert_spec = P(axis, None, None)
  return jax.shard_map(per_shard, mesh=layout.mesh, in_specs=(rows, rows, rows) + (expert_spec,) * 3,
                       out_specs=rows, check_vma=False)(h, experts, weights, *(w[n] for n in EXPERT_WEIGHTS))
