"""Copies of a model handle (d2f_jax.api.Model, or any frozen dataclass with .config, .graphdef, .state and
.placement) on a mesh or with another attention.

`shard_model` places the parameter state in training's shardings on a mesh; `with_attention` rebuilds only
the static graph (no copy of the weights).
"""

from __future__ import annotations

import dataclasses

from flax import nnx

from d2f_jax.decode.mesh import as_decode_mesh, place_state
from d2f_jax.models import abstract_model


def shard_model(model, mesh, rules=None):
  """A copy of `model` placed on `mesh`."""
  placement = as_decode_mesh(mesh, rules)
  state = model.state if placement is None else place_state(model.state, placement)
  return dataclasses.replace(model, state=state, placement=placement)


def with_attention(model, impl: str):
  """A copy of `model` whose attention runs as `impl` ('auto', 'xla', 'pallas', 'interpret_*'): a new
  static graph over the same parameter state (no copy of the weights)."""
  if impl == model.config.attention_impl:
    return model
  config = model.config.replace(attention_impl=impl)  # validates impl
  lora = getattr(nnx.merge(model.graphdef, model.state), "lora", None)
  graphdef, _ = nnx.split(abstract_model(config, lora))
  return dataclasses.replace(model, config=config, graphdef=graphdef)
