"""Ahead-of-time decode programs: `decode_program` builds `generate`'s jitted loop over abstract, sharded inputs.

Nothing is allocated: weights are abstract (from a ModelConfig, or a model's own state), and arguments are
jax.ShapeDtypeStructs carrying their shardings, so the program lowers and compiles without real devices.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from d2f_jax.decode.config import DecodeConfig, DecodeSpec, resolve
from d2f_jax.decode.mesh import as_decode_mesh
from d2f_jax.decode.result import DecodeResult
from d2f_jax.decode.runner.programs import decode_loop
from d2f_jax.models import ModelConfig, abstract_model, with_shardings


@dataclasses.dataclass(frozen=True)
class DecodeProgram:
  """The jitted decode loop of one (model, config, batch, prompt width, mesh) and abstract arguments for it.

  fn(params, prompt [B, P], prompt_len [B], key, knobs) -> DecodeResult (replicated), the very function
  `generate` runs. args: jax.ShapeDtypeStructs carrying their shardings (params by the rules, rows over
  the batch axes, the rest replicated), so `program.fn.lower(*program.args).compile()` needs no weights
  and no real devices. batch: the rows compiled (the batch asked for, padded to the row shards).
  """

  fn: Callable[..., DecodeResult]
  args: tuple
  spec: DecodeSpec
  batch: int

  def lower(self):
    return self.fn.lower(*self.args)


def decode_program(model, config: DecodeConfig, *, batch: int, prompt_width: int, mesh, rules=None
                   ) -> DecodeProgram:
  """Build the whole jitted decode loop for ahead-of-time compilation.

  model: a ModelConfig (abstract weights are built from it: nothing is allocated), or an object with
  .config, .graphdef and .state (concrete or abstract). config: any DecodeConfig method (d2f, threshold,
  vanilla, dream_vanilla, ar). prompt_width: the padded prompt length P. mesh: a jax Mesh over any devices
  (compile-only topologies included) with axes data / fsdp / tensor; rules default to training's.
  """
  if isinstance(model, ModelConfig):
    graphdef, state = nnx.split(abstract_model(model))
    model_config = model
  else:
    graphdef, state, model_config = model.graphdef, model.state, model.config
  for name, value in (("batch", batch), ("prompt_width", prompt_width)):
    if not isinstance(value, int) or value <= 0:
      raise ValueError(f"decode_program: {name} must be a positive int, got {value!r}")
  placement = as_decode_mesh(mesh, rules)
  if placement is None:
    raise ValueError("decode_program needs a mesh")
  spec, knobs = resolve(config, model_config)
  rows = placement.padded_batch(batch)
  rep = placement.replicated()

  def sds(x, sharding):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
  params = with_shardings(state, placement.param_shardings(state))
  args = (params, jax.ShapeDtypeStruct((rows, prompt_width), jnp.int32, sharding=placement.rows(2)),
          jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=placement.rows(1)),
          sds(jax.eval_shape(lambda: jax.random.key(0)), rep), jax.tree.map(lambda x: sds(x, rep), knobs))
  layout = placement.layout

  def fn(params, prompt, prompt_len, key, knobs):
    return decode_loop(graphdef, params, prompt, prompt_len, key, knobs, spec, layout)
  return DecodeProgram(fn=jax.jit(fn), args=args, spec=spec, batch=rows)
