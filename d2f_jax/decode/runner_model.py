"""The model handle every decoder takes (`DecodeModel`), and copies of it on a mesh or with another attention.

`shard_model` places the parameter state in training's shardings on a mesh; `with_attention` rebuilds only
the static graph (no copy of the weights).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flax import nnx

from d2f_jax.decode.mesh import DecodeMesh, as_decode_mesh, place_state
from d2f_jax.models import ModelConfig, Transformer


@dataclasses.dataclass(frozen=True)
class DecodeModel:
  """The model handle every decoder takes: a config, the static graph and the parameter state, with the
  tokenizer, the separate LoRA config, the directory it came from and (once `shard`ed) the mesh the state
  lives on. `d2f_jax.load_model` returns its subclass LoadedModel (adds logits / encode / decode)."""

  config: ModelConfig
  graphdef: Any  # nnx.GraphDef: static, hashable
  state: Any  # nnx.State: parameters (and LoRA parameters, when kept separate)
  tokenizer: Any = None
  placement: DecodeMesh | None = None
  lora: Any = None  # LoraConfig when the LoRA parameters are kept separate
  source: str = ""  # the directory it was loaded from ("" when built in memory)

  @classmethod
  def from_module(cls, module: nnx.Module, tokenizer=None) -> "DecodeModel":
    graphdef, state = nnx.split(module)
    return cls(config=module.config, graphdef=graphdef, state=state, tokenizer=tokenizer,
               lora=getattr(module, "lora", None))

  @property
  def mesh(self):
    return None if self.placement is None else self.placement.mesh

  def shard(self, mesh, rules=None) -> "DecodeModel":
    """A copy with its weights in the logical `rules`' shardings on `mesh` (default rules: training's)."""
    return shard_model(self, mesh, rules)

  def with_attention(self, impl: str) -> "DecodeModel":
    """A copy whose attention runs as `impl` ('auto', 'xla', 'pallas', 'interpret_gpu', 'interpret_tpu')."""
    return with_attention(self, impl)


def shard_model(model, mesh, rules=None):
  """A copy of `model` (a DecodeModel or LoadedModel) placed on `mesh`."""
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
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: Transformer(config, lora, rngs=nnx.Rngs(0))))
  return dataclasses.replace(model, config=config, graphdef=graphdef)
