"""Building the device mesh (data x fsdp x tensor) from sizes or a `data=2,tensor=4` string, and multi-host
start-up (jax.distributed) when the environment shows a multi-process launch."""

from __future__ import annotations

import logging
import math
import os
from typing import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh

from d2f_jax.sharding.rules import MESH_AXES

log = logging.getLogger(__name__)

# Environment variables that mean "this process is one of several" for jax.distributed.initialize().
MULTIPROCESS_ENV = ("JAX_COORDINATOR_ADDRESS", "COORDINATOR_ADDRESS", "MEGASCALE_COORDINATOR_ADDRESS")


def multiprocess_launch() -> bool:
  """Whether the environment shows this process is one of several (SLURM, Open MPI, a TPU pod slice, or an
  explicit coordinator)."""
  if any(os.environ.get(v) for v in MULTIPROCESS_ENV):
    return True
  for count_var in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
    if int(os.environ.get(count_var, "1") or 1) > 1:
      return True
  hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
  return len([h for h in hosts.split(",") if h]) > 1


def maybe_initialize_distributed(mode: str) -> bool:
  """jax.distributed.initialize() for 'on', or for 'auto' when `multiprocess_launch()`. Must run before any
  other JAX call; a second call is a no-op."""
  if mode not in ("auto", "on", "off"):
    raise ValueError(f"distributed must be 'auto', 'on' or 'off', got {mode!r}")
  if jax.distributed.is_initialized():
    return True
  if mode == "off" or (mode == "auto" and not multiprocess_launch()):
    return False
  jax.distributed.initialize()
  log.info("jax.distributed: process %d of %d", jax.process_index(), jax.process_count())
  return True


def parse_mesh(text: str, flag: str = "--mesh") -> dict[str, int]:
  """'data=2,tensor=4' -> {'data': 2, 'tensor': 4}; names and sizes are checked, errors name `flag`."""
  sizes: dict[str, int] = {}
  for part in (p.strip() for p in text.split(",") if p.strip()):
    axis, eq, value = part.partition("=")
    axis = axis.strip()
    if not eq or axis not in MESH_AXES:
      raise ValueError(f"{flag} {text!r}: expected comma-separated axis=size with axes {', '.join(MESH_AXES)}")
    if axis in sizes:
      raise ValueError(f"{flag} {text!r}: axis {axis!r} is given twice")
    try:
      size = int(value)
    except ValueError:
      raise ValueError(f"{flag} {text!r}: size of {axis!r} must be an int, got {value.strip()!r}") from None
    if size == 0 or size < -1:
      raise ValueError(f"{flag} {text!r}: size of {axis!r} must be positive or -1, got {size}")
    sizes[axis] = size
  if not sizes:
    raise ValueError(f"{flag} {text!r}: no axis given")
  return sizes


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
