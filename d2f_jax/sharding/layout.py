"""How the model's activations are split on a mesh: a layout the caller sets and the model obeys, without
the model knowing the rules.

Two consumers read the active `MeshLayout`:
- the transformer pins its residual stream [B, T, E] to the batch split at every layer boundary
  (`constrain_batch`). Without it the partitioner may gather the batch of per-layer activations across the
  fsdp group (the AOT check measured 16 rows per device where 2 were due, 166 GiB for LLaDA-8B on v5p-64);
- every Pallas kernel call (kernels/attend.py) runs inside `jax.shard_map` over the layout's batch and head
  axes: Mosaic / Triton calls cannot be partitioned automatically.

Trace the model inside `mesh_layout(layout)`. The layout is a context variable, not part of any jit cache
key: enter it inside the jitted function (as train/step.py does) or pass the layout as a static argument.
Outside the context everything is a no-op and kernels run unsharded.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math

import jax
from jax.sharding import NamedSharding, PartitionSpec

from d2f_jax.sharding.rules import rule_axes


@dataclasses.dataclass(frozen=True)
class MeshLayout:
  """How the model's activations are split on a mesh (hashable: usable as a static jit argument)."""

  mesh: jax.sharding.Mesh  # a concrete Mesh (or an AbstractMesh, for lowering without devices)
  batch_axes: tuple[str, ...]  # mesh axes the batch dim [B] is split over, e.g. ("data", "fsdp")
  head_axis: str | None  # mesh axis attention heads are split over (e.g. "tensor"); None = replicated
  expert_axis: str | None = None  # mesh axis a MoE layer's experts split over (models/expert_parallel.py)

  def __post_init__(self):
    names = tuple(self.mesh.axis_names)
    if isinstance(self.batch_axes, str):
      object.__setattr__(self, "batch_axes", (self.batch_axes,))
    object.__setattr__(self, "batch_axes", tuple(self.batch_axes))
    for axis in (*self.batch_axes, *(a for a in (self.head_axis, self.expert_axis) if a is not None)):
      if axis not in names:
        raise ValueError(f"MeshLayout: axis {axis!r} is not a mesh axis; mesh axes are {names}")
    if len(set(self.batch_axes)) != len(self.batch_axes):
      raise ValueError(f"MeshLayout.batch_axes repeats an axis: {self.batch_axes}")
    if self.head_axis is not None and self.head_axis in self.batch_axes:
      raise ValueError(f"MeshLayout.head_axis {self.head_axis!r} is also a batch axis {self.batch_axes}")

  @property
  def num_devices(self) -> int:
    return math.prod(self.mesh.shape.values())

  def batch_split(self, batch: int) -> tuple[str, ...]:
    """The batch axes that split a batch of `batch` rows: in order, skipping size-1 axes and any axis whose
    size (times the ones already chosen) does not divide `batch` (those stay replicated)."""
    chosen: list[str] = []
    for axis in self.batch_axes:
      size = self.mesh.shape[axis]
      if size > 1 and batch % (size * math.prod(self.mesh.shape[a] for a in chosen)) == 0:
        chosen.append(axis)
    return tuple(chosen)

  def head_size(self) -> int:
    """Size of the head axis (1 without one)."""
    return 1 if self.head_axis is None else self.mesh.shape[self.head_axis]


_LAYOUT: contextvars.ContextVar[MeshLayout | None] = contextvars.ContextVar("d2f_mesh_layout", default=None)


@contextlib.contextmanager
def mesh_layout(layout: MeshLayout | None):
  """Trace the model inside this so its activations and kernel calls follow `layout` (None: unsharded)."""
  if layout is not None and not isinstance(layout, MeshLayout):
    raise TypeError(f"mesh_layout expects a MeshLayout or None, got {type(layout).__name__}")
  token = _LAYOUT.set(layout)
  try:
    yield
  finally:
    _LAYOUT.reset(token)


def current_layout() -> MeshLayout | None:
  """The layout of the innermost `mesh_layout` context (None outside any)."""
  return _LAYOUT.get()


def layout_from_rules(mesh, rules) -> MeshLayout:
  """The layout the trainer's logical-axis rules (sharding/rules.py) give activations: the batch over the
  'batch' rule's mesh axes, heads over the first axis of the 'heads' rule that has size > 1 and is not
  already a batch axis (an axis splits one dimension of an array only, as in `logical_spec`), experts over
  the first axis of the 'expert' rule that has size > 1 (a batch axis too: the tokens then travel to their
  experts by all-to-all)."""
  batch_axes = tuple(a for a in rule_axes(rules, "batch", mesh) if mesh.shape[a] > 1)
  heads = [a for a in rule_axes(rules, "heads", mesh) if mesh.shape[a] > 1 and a not in batch_axes]
  experts = [a for a in rule_axes(rules, "expert", mesh) if mesh.shape[a] > 1]
  return MeshLayout(mesh=mesh, batch_axes=batch_axes, head_axis=heads[0] if heads else None,
                    expert_axis=experts[0] if experts else None)


def constrain_batch(x: jax.Array) -> jax.Array:
  """x [B, ...] constrained to the active layout's batch split (rows over the batch axes, the rest
  replicated); unchanged outside a layout or on one device."""
  layout = current_layout()
  if layout is None or layout.num_devices == 1:
    return x
  axes = layout.batch_split(x.shape[0])
  spec = PartitionSpec(axes or None, *([None] * (x.ndim - 1)))
  return jax.lax.with_sharding_constraint(x, NamedSharding(layout.mesh, spec))
