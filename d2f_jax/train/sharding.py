"""Device mesh (data x fsdp x tensor), logical-axis rules, and multi-host start-up.

Parameters carry logical axis names (models/transformer.py); `logical_spec` maps them to mesh axes with the
config's rules, maxtext-style. A rule is skipped for a dimension it does not divide (e.g. Dream's 4 KV heads
on 8-way tensor parallelism), so every preset runs on every mesh, just with more replication.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from d2f_jax.train.config import MESH_AXES

log = logging.getLogger(__name__)

Rules = tuple[tuple[str, Any], ...]

# Environment variables that mean "this process is one of several" for jax.distributed.initialize().
_MULTIPROCESS_ENV = ("JAX_COORDINATOR_ADDRESS", "COORDINATOR_ADDRESS", "MEGASCALE_COORDINATOR_ADDRESS")


def _multiprocess_launch() -> bool:
  if any(os.environ.get(v) for v in _MULTIPROCESS_ENV):
    return True
  for count_var in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
    if int(os.environ.get(count_var, "1") or 1) > 1:
      return True
  hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
  return len([h for h in hosts.split(",") if h]) > 1


def maybe_initialize_distributed(mode: str) -> bool:
  """jax.distributed.initialize() for 'on', or for 'auto' when the environment shows a multi-process
  launch (SLURM, Open MPI, TPU pod slice, explicit coordinator). Must run before any other JAX call."""
  if mode not in ("auto", "on", "off"):
    raise ValueError(f"distributed must be 'auto', 'on' or 'off', got {mode!r}")
  if jax.distributed.is_initialized():
    return True
  if mode == "off" or (mode == "auto" and not _multiprocess_launch()):
    return False
  jax.distributed.initialize()
  log.info("jax.distributed: process %d of %d", jax.process_index(), jax.process_count())
  return True


def make_mesh(sizes: dict, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Mesh over `devices` (default all) with axes (data, fsdp, tensor); one size may be -1 (the rest)."""
  devices = list(jax.devices() if devices is None else devices)
  shape = [int(sizes.get(a, 1)) for a in MESH_AXES]
  if shape.count(-1) > 1:
    raise ValueError(f"mesh {dict(sizes)}: at most one axis may be -1")
  known = math.prod(s for s in shape if s != -1)
  if -1 in shape:
    if len(devices) % known:
      raise ValueError(f"mesh {dict(sizes)}: {len(devices)} devices are not a multiple of {known}")
    shape[shape.index(-1)] = len(devices) // known
  if math.prod(shape) != len(devices):
    raise ValueError(f"mesh {dict(zip(MESH_AXES, shape))} needs {math.prod(shape)} devices, found {len(devices)}")
  try:  # topology-aware placement (ICI rings on TPU, NVLink islands on GPU) when the platform has one
    grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
  except (ValueError, NotImplementedError, AssertionError):
    grid = np.asarray(devices).reshape(shape)
  return Mesh(grid, MESH_AXES)


def logical_spec(axes: Sequence[str | None], rules: Rules, mesh: Mesh, shape: Sequence[int] | None = None) -> P:
  """PartitionSpec of an array with logical `axes`: each maps to its rule's mesh axes that are still unused
  in this array, of size > 1, and (given `shape`) divide the dimension."""
  table = dict(rules)
  used: set[str] = set()
  spec = []
  for dim, name in enumerate(axes):
    if name is not None and name not in table:
      raise ValueError(f"logical axis {name!r} has no rule in logical_axis_rules (known: {sorted(table)})")
    target = table.get(name) if name is not None else None
    target = (target,) if isinstance(target, str) else tuple(target or ())
    chosen = []
    for axis in target:
      if axis not in mesh.shape:
        raise ValueError(f"logical_axis_rules maps {name!r} to mesh axis {axis!r}; mesh axes are {mesh.axis_names}")
      size = mesh.shape[axis] * math.prod(mesh.shape[a] for a in chosen)
      if axis in used or mesh.shape[axis] == 1 or (shape is not None and shape[dim] % size):
        continue
      chosen.append(axis)
    used.update(chosen)
    spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
  return P(*spec)


def state_shardings(abstract: nnx.State, mesh: Mesh, rules: Rules) -> dict:
  """Pure-dict tree of NamedShardings for an abstract nnx.State whose Variables carry `out_sharding`."""
  def one(var):
    axes = var.get_metadata().get("out_sharding") or (None,) * len(var.shape)
    return NamedSharding(mesh, logical_spec(axes, rules, mesh, var.shape))
  return nnx.to_pure_dict(jax.tree.map(one, abstract, is_leaf=lambda x: isinstance(x, nnx.Variable)))


def batch_sharding(mesh: Mesh, rules: Rules, ndim: int = 2) -> NamedSharding:
  """Rows split over the rules' `batch` axes, everything else replicated."""
  return NamedSharding(mesh, logical_spec(("batch",) + (None,) * (ndim - 1), rules, mesh))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def abstract_with(tree, shardings) -> Any:
  """ShapeDtypeStructs of `tree` carrying `shardings` (for jit out_shardings and orbax restore targets)."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def host_to_global(tree, shardings) -> Any:
  """Place host numpy arrays (the full value, on every process) into global arrays with `shardings`,
  copying only the slices each process's devices hold."""
  def put(x, sharding):
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
  return jax.tree.map(put, tree, shardings)
