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

Without an active layout, on one device, where the axis does not divide the experts, or on GPUs (see
`_grouped_matmul_in_shard_map`), `sharded_experts` returns None and the caller computes the experts as on one
device (models/moe.py), which XLA's partitioner splits by the sharding rules.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from d2f_jax.sharding.layout import MeshLayout, current_layout

EXPERT_WEIGHTS = ("expert_gate", "expert_up", "expert_down")


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
  return jax.nn.silu(gate) * up


def local_experts(h: jax.Array, ids: jax.Array, weights: jax.Array, w: dict, first: jax.Array | int) -> jax.Array:
  """sum_k weights[n, k] * expert_{ids[n, k]}(h[n]) [N, E] float32 over the (token, choice) pairs whose expert
  is one of this shard's [first, first + X_local); h [N, E], ids / weights [N, k] (global ids; -1: no pair).
  The pairs are sorted by local expert (others last) and run as one grouped matmul per projection."""
  dtype = h.dtype
  n, k = ids.shape
  count = w["expert_gate"].shape[0]  # X_local
  flat = ids.reshape(-1)  # [N * k]
  local = flat - first
  mine = (flat >= 0) & (local >= 0) & (local < count)
  key = jnp.where(mine, local, count)  # pairs of other shards sort last
  order = jnp.argsort(key, stable=True)
  token = order // k  # [N * k]: the token of each sorted pair
  rows = h[token]  # [N * k, E]
  if count == 1:  # one expert here: a plain matmul (XLA:GPU finds no tiling for some one-group ragged dots)
    gate = jnp.einsum("me,ef->mf", rows, w["expert_gate"][0].astype(dtype))
    up = jnp.einsum("me,ef->mf", rows, w["expert_up"][0].astype(dtype))
    out = jnp.einsum("mf,fe->me", swiglu(gate, up), w["expert_down"][0].astype(dtype))
  else:
    group_sizes = jnp.zeros((count,), jnp.int32).at[key].add(1, mode="drop")  # [X_local]
    gate = jax.lax.ragged_dot(rows, w["expert_gate"].astype(dtype), group_sizes)  # [N * k, F]
    up = jax.lax.ragged_dot(rows, w["expert_up"].astype(dtype), group_sizes)
    out = jax.lax.ragged_dot(swiglu(gate, up), w["expert_down"].astype(dtype), group_sizes)  # [N * k, E]
  scale = jnp.where(mine, weights.reshape(-1), 0.0)[order]  # [N * k]: zero for other shards' pairs
  weighted = jnp.where(mine[order][:, None], out.astype(jnp.float32), 0.0) * scale[:, None]
  return jnp.zeros((n, h.shape[-1]), jnp.float32).at[token].add(weighted)


def _replicated_tokens(h, experts, weights, w, axis: str):
  """Per shard: every local pair is here; compute this shard's experts' share, add the shards' shares."""
  first = jax.lax.axis_index(axis) * w["expert_gate"].shape[0]
  return jax.lax.psum(local_experts(h, experts, weights, w, first), axis)


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
  recv_ids = jax.lax.all_to_all(send_ids, axis, 0, 0, tiled=True).reshape(-1, 1)  # [S * C, 1]
  first = jax.lax.axis_index(axis) * count
  done = local_experts(recv.reshape(-1, h.shape[-1]), recv_ids, jnp.ones(recv_ids.shape, jnp.float32), w,
                       first)  # [S * C, E]
  back = jax.lax.all_to_all(done.reshape(recv.shape), axis, 0, 0, tiled=True)  # [S, C, E]: row d from shard d
  out = back.sum(axis=0).reshape(n, k, -1)  # each pair came back from one shard, zeros from the rest
  return jnp.einsum("nke,nk->ne", out, weights)


def _grouped_matmul_in_shard_map(mesh) -> bool:
  """Whether the mesh's compiler takes `ragged_dot` inside shard_map. XLA:GPU (jax 0.10.2) does not always:
  tiny-llada2's decode on 8xH100 fails with "Couldn't find output tile sizes" for the grouped matmul's dot,
  while the same matmul partitioned by XLA compiles; on GPUs the experts stay on that path."""
  devices = getattr(mesh, "devices", None)
  return devices is None or devices.flat[0].platform not in ("gpu", "cuda", "rocm")


def expert_axis(layout: MeshLayout | None, num_experts: int) -> str | None:
  """The mesh axis the experts split over under `layout`, if any and if its size divides them."""
  if layout is None or layout.expert_axis is None or not _grouped_matmul_in_shard_map(layout.mesh):
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
