"""Activation layout hints that the trainer sets and the model obeys, without the model knowing the mesh.

Under a sharded jit the partitioner may otherwise gather the batch of per-layer activations across the
fsdp group (the AOT check measured 16 rows per device where 2 were due, 166 GiB for LLaDA-8B on v5p-64).
The trainer traces its step inside `batch_sharded_activations(batch_sharding)`; the transformer pins its
residual stream [B, T, E] to that batch split at every layer boundary. Outside the context: no-op.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
from jax.sharding import NamedSharding, PartitionSpec

_BATCH_SHARDING: contextvars.ContextVar[NamedSharding | None] = contextvars.ContextVar("d2f_batch_sharding",
                                                                                      default=None)


@contextlib.contextmanager
def batch_sharded_activations(sharding: NamedSharding | None):
  """Trace the model inside this to keep activations split over the batch axes of `sharding` ([B, ...])."""
  token = _BATCH_SHARDING.set(sharding)
  try:
    yield
  finally:
    _BATCH_SHARDING.reset(token)


def constrain_batch(x: jax.Array) -> jax.Array:
  """x [B, ...] constrained to the active batch split (rows over the batch axes, the rest replicated)."""
  sharding = _BATCH_SHARDING.get()
  if sharding is None:
    return x
  spec = PartitionSpec(sharding.spec[0] if len(sharding.spec) else None, *([None] * (x.ndim - 1)))
  return jax.lax.with_sharding_constraint(x, NamedSharding(sharding.mesh, spec))
