"""Putting values onto a mesh: host arrays into global arrays (multi-host safe) and abstract targets."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding


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


def to_global(x, target: NamedSharding) -> jax.Array:
  """x (host or device array, the same value on every process) as a global array with `target`. A mesh
  spanning several processes cannot be reached by device_put: each process then fills its own shards."""
  if isinstance(x, jax.Array) and x.sharding == target:
    return x
  if target.is_fully_addressable:
    return jax.device_put(x, target)
  if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    data = to_global(jax.random.key_data(x), target)
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
  return host_to_global(np.asarray(jax.device_get(x)), target)
