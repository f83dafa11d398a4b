"""Decoding on a device mesh: where weights, prompt rows and loop state live, and the layout the loop is traced in.

The mesh and logical-axis rules are training's (d2f_jax/sharding: data x fsdp x tensor, heads / kv_heads /
mlp / vocab over tensor, embed over fsdp, rows over data x fsdp), so a checkpoint decodes on the mesh it was
trained on. The static KV cache [L, B, S, K, D] splits rows like the batch and kv heads over the head axis
where it divides them (models/kv_cache.py). The batch is padded up to a multiple of the row shards with
copies of the first prompt: a copy finishes exactly when its original does, so padding never lengthens
the loop, and the rows are cut off again from the result.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from d2f_jax import sharding
from d2f_jax.models.kv_cache import KVCache
from d2f_jax.sharding import DEFAULT_RULES, MeshLayout, layout_from_rules, normalize_rules, to_global


@dataclasses.dataclass(frozen=True)
class DecodeMesh:
  """A mesh and the rules that place a decode on it (hashable: part of the jit cache key via `layout`)."""

  mesh: Mesh
  rules: sharding.Rules = DEFAULT_RULES

  def __post_init__(self):
    if not isinstance(self.mesh, (Mesh, jax.sharding.AbstractMesh)):
      raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(self.mesh).__name__}")
    object.__setattr__(self, "rules", normalize_rules(self.rules))

  @property
  def layout(self) -> MeshLayout:
    """Activations: rows over the 'batch' rule's axes, heads over the 'heads' rule's axis."""
    return layout_from_rules(self.mesh, self.rules)

  @property
  def row_shards(self) -> int:
    """How many ways the batch splits: the product of the layout's batch axes."""
    return math.prod(self.mesh.shape[a] for a in self.layout.batch_axes)

  def padded_batch(self, batch: int) -> int:
    return -(-batch // self.row_shards) * self.row_shards

  def rows(self, ndim: int) -> NamedSharding:
    """[B, ...] split over the batch axes, the rest replicated."""
    axes = self.layout.batch_axes
    return NamedSharding(self.mesh, P(axes or None, *([None] * (ndim - 1))))

  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, P())

  def param_shardings(self, state) -> dict:
    """Pure-dict tree of NamedShardings for a (concrete or abstract) nnx.State, by the rules."""
    return sharding.state_shardings(state, self.mesh, self.rules)


def as_decode_mesh(mesh, rules=None) -> DecodeMesh | None:
  """A DecodeMesh from a Mesh (+ rules), a DecodeMesh, or None (one device: no placement at all)."""
  if mesh is None:
    if rules is not None:
      raise ValueError("rules were given without a mesh")
    return None
  if isinstance(mesh, DecodeMesh):
    return mesh if rules is None else DecodeMesh(mesh.mesh, rules)
  return DecodeMesh(mesh, rules)


def _with_values(state, values: dict):
  """A new nnx.State with `state`'s structure and metadata holding the pure-dict `values`."""
  new = jax.tree.map(lambda x: x, state)  # fresh Variables; `state` itself stays untouched
  nnx.replace_by_pure_dict(new, values)
  return new


def place_state(state, placement: DecodeMesh):
  """`state` (nnx.State of jax or numpy arrays) in the rules' shardings. Host (numpy) leaves are copied
  slice by slice straight to the devices that hold them (multi-host safe, no full copy on one device);
  device leaves already in place are not copied."""
  shardings = placement.param_shardings(state)
  values = nnx.to_pure_dict(state)

  return _with_values(state, jax.tree.map(to_global, values, shardings))


def pad_rows(prompt: jax.Array, prompt_len: jax.Array, batch: int):
  """prompt [B, P], prompt_len [B] -> [batch, P], [batch] with copies of row 0 appended."""
  extra = batch - prompt.shape[0]
  if extra == 0:
    return prompt, prompt_len
  prompt = jnp.concatenate([prompt, jnp.repeat(prompt[:1], extra, axis=0)], axis=0)
  return prompt, jnp.concatenate([prompt_len, jnp.repeat(prompt_len[:1], extra)])


def place_inputs(placement: DecodeMesh, prompt, prompt_len, key, knobs):
  """Pad the rows to a multiple of the row shards and put every input where the loop expects it; the same
  shardings every call, so a second call with the same shapes reuses the compiled program."""
  prompt, prompt_len = pad_rows(prompt, prompt_len, placement.padded_batch(prompt.shape[0]))
  rep = placement.replicated()
  return (to_global(prompt, placement.rows(2)), to_global(prompt_len, placement.rows(1)), to_global(key, rep),
          jax.tree.map(lambda x: to_global(x, rep), knobs))


def constrain_loop_state(state: Any, layout: MeshLayout | None, batch: int) -> Any:
  """Pin a loop state (D2FState, FullState, ARState, DecodeResult) to the layout inside the jitted loop:
  KV caches by rows and kv heads (KVCache.constrain), every other [batch, ...] leaf by rows, scalars (step
  counter, PRNG key) replicated. Without it the partitioner may pick a replicated cache for the carry."""
  if layout is None or layout.num_devices == 1:
    return state
  rows = layout.batch_split(batch) or None

  def one(x):
    if isinstance(x, KVCache):
      return x.constrain(layout)
    if not hasattr(x, "ndim"):
      return x
    spec = P(rows, *([None] * (x.ndim - 1))) if x.ndim and x.shape[0] == batch else P()
    return jax.lax.with_sharding_constraint(x, NamedSharding(layout.mesh, spec))
  return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, KVCache))


def replicate(tree: Any, layout: MeshLayout | None) -> Any:
  """The (small) result replicated on every device, so every process can read all of it."""
  if layout is None or layout.num_devices == 1:
    return tree
  return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(layout.mesh, P())), tree)
