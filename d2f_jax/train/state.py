"""The train state (step, trainable params, optimizer state, RNG) and where each of its leaves lives.

Frozen base weights are not part of it: they never change, are not donated, and are not checkpointed
(they are re-read from `model.path` on resume), so a LoRA checkpoint is megabytes, not the whole model.
A full fine-tune without a teacher (mdm, ar) keeps no frozen tree at all: its state is the whole model.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from d2f_jax import sharding
from d2f_jax.train.model import TrainModels, pure_abstract, init_trainable
from d2f_jax.train.optim import OptimSpec, make_optimizer


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # int32 []
  params: Any  # trainable: the LoRA adapter or the whole student
  opt_state: Any
  rng: jax.Array  # uint32 [2], split once per step

  def to_dict(self) -> dict:
    return {"step": self.step, "params": self.params, "opt_state": self.opt_state, "rng": self.rng}

  @classmethod
  def from_dict(cls, d: dict) -> "TrainState":
    return cls(step=d["step"], params=d["params"], opt_state=d["opt_state"], rng=d["rng"])


@functools.lru_cache(maxsize=16)
def state_shardings(models: TrainModels, optim: OptimSpec, mesh: Mesh, rules: sharding.Rules) -> TrainState:
  """Shardings of every TrainState leaf: params by their logical axes, Adam moments like their params,
  counters and the RNG replicated."""
  abstract = models.abstract_trainable()
  params = sharding.state_shardings(abstract, mesh, rules)
  opt = make_optimizer(optim)
  opt_abstract = jax.eval_shape(opt.init, pure_abstract(abstract))
  rep = sharding.replicated(mesh)
  opt_state = optax.tree_map_params(opt, lambda _, s: s, opt_abstract, params, transform_non_params=lambda _: rep)
  return TrainState(step=rep, params=params, opt_state=opt_state, rng=rep)


def abstract_state(models: TrainModels, optim: OptimSpec, mesh: Mesh, rules: sharding.Rules) -> TrainState:
  """ShapeDtypeStructs with shardings: the restore target of a checkpoint."""
  params = pure_abstract(models.abstract_trainable())
  shapes = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=params,
                      opt_state=jax.eval_shape(make_optimizer(optim).init, params),
                      rng=jax.ShapeDtypeStruct((2,), jnp.uint32))
  return sharding.abstract_with(shapes, state_shardings(models, optim, mesh, rules))


def create_state(models: TrainModels, optim: OptimSpec, base: dict | None, seed: int, mesh: Mesh,
                 rules: sharding.Rules) -> TrainState:
  """A fresh state, computed on the devices directly into its shardings. `base`: the base weights (LoRA,
  or the starting point of a full fine-tune), or None for a random full-model init."""
  def init(base):
    params = init_trainable(models, base, seed)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=make_optimizer(optim).init(params),
                      rng=jax.random.PRNGKey(seed + 1))
  return jax.jit(init, out_shardings=state_shardings(models, optim, mesh, rules))(base)
