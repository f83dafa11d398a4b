"""The mesh axes and the logical-axis rules: how a named array dimension maps to mesh axes (maxtext-style).

Parameters carry logical axis names (models/transformer.py); `logical_spec` maps them to mesh axes with a rules
table. A rule is skipped for a dimension it does not divide (e.g. Dream's 4 KV heads on 8-way tensor
parallelism), so every preset runs on every mesh, just with more replication. Training and decoding read the
same table, so a checkpoint decodes on the mesh it was trained on.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")

Rules = tuple[tuple[str, Any], ...]

# logical axis -> mesh axes (tried in order; a mesh axis is used once per array, and a dimension it does not
# divide stays replicated). Parameters are FSDP-sharded on `embed`, tensor-parallel on heads / mlp / vocab;
# activations split their batch over data x fsdp.
DEFAULT_RULES: Rules = (
    ("batch", ("data", "fsdp")),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("expert", "tensor"),  # experts split whole over the tensor axis (expert parallelism) ...
    ("expert_mlp", "tensor"),  # ... or, where their count does not divide it, each expert's hidden dim
    ("vocab", "tensor"),
    ("layers", None),
    ("head_dim", None),
    ("lora_rank", None),
    ("length", None),
)


def normalize_rules(rules) -> Rules:
  """Rules as a hashable tuple of (logical name, mesh axes) pairs (a config's lists become tuples); None:
  the default rules."""
  rules = DEFAULT_RULES if rules is None else rules
  return tuple((name, tuple(axes) if isinstance(axes, (list, tuple)) else axes) for name, axes in rules)


def rule_axes(rules, name: str, mesh) -> tuple[str, ...]:
  """The mesh axes the rule for logical axis `name` names (checked against the mesh)."""
  target: Any = dict(rules).get(name)
  axes = (target,) if isinstance(target, str) else tuple(target or ())
  for axis in axes:
    if axis not in mesh.shape:
      raise ValueError(f"logical_axis_rules maps {name!r} to mesh axis {axis!r}; mesh axes are {mesh.axis_names}")
  return axes


def packed_axis(name: str, unit: int) -> str:
  """The logical axis of a dimension packing whole `name` units of `unit` elements each (heads with their
  head_dim: "heads:128"): sharded by `name`'s rule, only where the shards hold whole units."""
  return f"{name}:{unit}"


def _unpack(name: str | None) -> tuple[str | None, int]:
  """'heads:128' -> ('heads', 128); 'embed' -> ('embed', 1)."""
  if name is None or ":" not in name:
    return name, 1
  base, unit = name.split(":", 1)
  if not unit.isdigit() or int(unit) <= 0:
    raise ValueError(f"packed logical axis {name!r}: expected 'name:unit' with a positive integer unit")
  return base, int(unit)


def logical_spec(axes: Sequence[str | None], rules: Rules, mesh, shape: Sequence[int] | None = None) -> P:
  """PartitionSpec of an array with logical `axes`: each maps to its rule's mesh axes that are still unused
  in this array, of size > 1, and (given `shape`) divide the dimension (in whole units, for a packed axis)."""
  table = dict(rules)
  used: set[str] = set()
  spec = []
  for dim, packed in enumerate(axes):
    name, unit = _unpack(packed)
    if shape is not None and shape[dim] % unit:
      raise ValueError(f"logical axis {packed!r} packs units of {unit}, but the dimension has size {shape[dim]}")
    if name is not None and name not in table:
      raise ValueError(f"logical axis {name!r} has no rule in logical_axis_rules (known: {sorted(table)})")
    chosen: list[str] = []
    for axis in rule_axes(rules, name, mesh) if name is not None else ():
      size = mesh.shape[axis] * math.prod(mesh.shape[a] for a in chosen)
      if axis in used or mesh.shape[axis] == 1 or (shape is not None and (shape[dim] // unit) % size):
        continue
      chosen.append(axis)
    used.update(chosen)
    spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
  return P(*spec)


def state_shardings(abstract: nnx.State, mesh, rules: Rules) -> dict:
  """Pure-dict tree of NamedShardings for an (abstract or concrete) nnx.State whose Variables carry
  `out_sharding` logical axes."""
  def one(var):
    axes = var.get_metadata().get("out_sharding") or (None,) * len(var.shape)
    return NamedSharding(mesh, logical_spec(axes, rules, mesh, var.shape))
  return nnx.to_pure_dict(jax.tree.map(one, abstract, is_leaf=lambda x: isinstance(x, nnx.Variable)))


def batch_sharding(mesh, rules: Rules, ndim: int = 2) -> NamedSharding:
  """Rows split over the rules' `batch` axes, everything else replicated."""
  return NamedSharding(mesh, logical_spec(("batch",) + (None,) * (ndim - 1), rules, mesh))


def replicated(mesh) -> NamedSharding:
  return NamedSharding(mesh, P())
