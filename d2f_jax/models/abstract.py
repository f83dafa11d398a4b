"""The one builder of abstract models: a Transformer's graph and weights as shapes, nothing allocated, and those
weights given shardings (what ahead-of-time compiles, cost projections and restores take)."""

from __future__ import annotations

import jax
from flax import nnx

from d2f_jax.models.config import LoraConfig, ModelConfig
from d2f_jax.models.transformer import Transformer


def abstract_model(config: ModelConfig, lora: LoraConfig | None = None) -> nnx.Module:
  """The model with every array a ShapeDtypeStruct (`nnx.split` it for graphdef and state)."""
  return nnx.eval_shape(lambda: Transformer(config, lora, rngs=nnx.Rngs(0)))


def with_shardings(state: nnx.State, shardings) -> nnx.State:
  """A copy of the abstract `state` whose leaves carry `shardings` (a tree of the pure dict's structure; a None
  leaf: no sharding)."""
  pure = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), nnx.to_pure_dict(state),
                      shardings)
  params = jax.tree.map(lambda x: x, state)
  nnx.replace_by_pure_dict(params, pure)
  return params
