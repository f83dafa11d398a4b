"""The jitted train and eval steps, shared by every objective (train/objectives.py).

One step: split the RNG, prepare the whole batch once (noise it, pick targets), then scan over microbatches
summing gradients of the objective's *summed* loss and its denominator (masked / response / target count);
dividing at the end makes the update identical to the one of the whole batch at once (and to any data /
fsdp split of it), whatever `micro_batches` is.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding

from d2f_jax import sharding
from d2f_jax.sharding import MeshLayout, layout_from_rules, mesh_layout
from d2f_jax.train import objectives
from d2f_jax.train.model import TrainModels
from d2f_jax.train.optim import OptimSpec, learning_rate, make_optimizer
from d2f_jax.train.router_stats import router_metrics
from d2f_jax.train.schedule import Schedule
from d2f_jax.train.state import TrainState, state_shardings


@dataclasses.dataclass(frozen=True)
class StepSpec:
  """Everything static about a step; hashable, so equal specs share one compiled program."""

  models: TrainModels
  schedule: Schedule
  optim: OptimSpec
  block_size: int
  micro_batches: int = 1
  loss_chunk: int = 0
  batch_sharding: NamedSharding | None = None  # rows of each microbatch inside the step
  objective: str = "distill"  # a key of objectives.OBJECTIVES
  mdm_eps: float = 1e-3  # mdm: the mask ratio t ~ U(mdm_eps, 1)
  mdm_semi_ar: float = 0.0  # mdm: fraction of rows noised as a semi-AR decode's states (loss_mdm.py)
  mdm_window: int = 32  # mdm: their partly masked window after the cut
  mdm_suffix_weight: float = 1.0  # mdm: the loss weight's factor on the all-masked suffix after the window
  mdm_ar_weight: float = 0.0  # mdm: factor of the causal next-token CE of the clean rows added to the loss
  # How the model's activations and kernel calls split on the mesh: the rules' layout (spec_from_config and
  # the compiled steps fill it from the mesh and rules); None only for a spec used off any mesh.
  layout: MeshLayout | None = None

  def __post_init__(self):
    if objectives.get(self.objective).teacher and not self.models.teacher:
      raise ValueError(f"objective {self.objective!r} needs a teacher: TrainModels.create(..., teacher=True)")
    if self.mdm_ar_weight and not self.models.config.logit_shift:
      # Output row i predicts token i + 1 under the AR loss and token i under an unshifted model's MDM loss:
      # one head cannot serve both. Dream's layout (logit_shift) predicts i + 1 under both.
      raise ValueError(f"mdm.ar_weight={self.mdm_ar_weight}: needs a model with Dream's shifted logits "
                       "(ModelConfig.logit_shift=True); this model's output row i predicts its own token i")

  def traced_layout(self):
    """The context the model is traced in, by the train step and the eval step alike."""
    return mesh_layout(self.layout)

  def with_layout(self, mesh: Mesh, rules: sharding.Rules) -> "StepSpec":
    """This spec with the layout the rules give activations on `mesh` (unchanged when it has one)."""
    return self if self.layout is not None else dataclasses.replace(self, layout=layout_from_rules(mesh, rules))

  @property
  def obj(self) -> objectives.Objective:
    return objectives.get(self.objective)


def spec_from_config(config, models: TrainModels, mesh: Mesh, rules: sharding.Rules) -> StepSpec:
  """The StepSpec of a run config on `mesh`: what the Trainer compiles, and so what `python -m d2f_jax.aot`
  compiles for a target (one function, so the check cannot drift from the run)."""
  return StepSpec(models=models, schedule=Schedule(**config.schedule.to_dict()),
                  optim=OptimSpec.from_config(config.optim, config.total_steps), block_size=config.block_size,
                  micro_batches=config.micro_batches, loss_chunk=config.loss_chunk,
                  batch_sharding=sharding.batch_sharding(mesh, rules), objective=config.objective,
                  mdm_eps=float(config.mdm.eps), mdm_semi_ar=float(config.mdm.get("semi_ar", 0.0)),
                  mdm_window=int(config.mdm.get("window", 32)),
                  mdm_suffix_weight=float(config.mdm.get("suffix_weight", 1.0)),
                  mdm_ar_weight=float(config.mdm.get("ar_weight", 0.0)), layout=layout_from_rules(mesh, rules))


def _microbatches(tree, m: int, batch_sharding):
  """[B, ...] -> [M, B/M, ...] taking every M-th row, so each microbatch is spread over all batch shards."""
  def split(x):
    y = x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)
    if batch_sharding is not None:
      spec = batch_sharding.spec
      y = jax.lax.with_sharding_constraint(
          y, NamedSharding(batch_sharding.mesh, jax.sharding.PartitionSpec(None, spec[0], *([None] * (y.ndim - 2)))))
    return y
  return jax.tree.map(split, tree)


def _dropout_key(spec: StepSpec, key, index):
  lora = spec.models.lora
  return None if lora is None or lora.dropout == 0.0 else jax.random.fold_in(key, index)


def loss_and_grads(spec: StepSpec, trainable: dict, frozen: dict, batch: dict, key: jax.Array):
  """(grads of the mean loss, sums) for one batch {'tokens' [B, T], 'prompt_len' [B]}."""
  obj = spec.obj
  noise_key, dropout_key = jax.random.split(key)
  inputs = obj.prepare(spec, noise_key, batch)

  def sums_fn(params, inputs, index):
    with spec.traced_layout():
      sums = obj.sums(spec, params, frozen, inputs, _dropout_key(spec, dropout_key, index))
    return sums["ce"], sums

  grad_fn = jax.grad(sums_fn, has_aux=True)
  if spec.micro_batches == 1:
    grads, sums = grad_fn(trainable, inputs, 0)
  else:
    micro = _microbatches(inputs, spec.micro_batches, spec.batch_sharding)

    def body(carry, xs):
      index, mb_inputs = xs
      return jax.tree.map(jnp.add, carry, grad_fn(trainable, mb_inputs, index)), None

    zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(grad_fn, trainable, inputs, 0))
    (grads, sums), _ = jax.lax.scan(body, zeros, (jnp.arange(spec.micro_batches), micro))
  count = jnp.maximum(sums[obj.denominator], 1.0)
  return jax.tree.map(lambda g: g / count, grads), sums


def summarize(sums: dict, objective: str = "distill") -> dict:
  """Metrics ('loss', ...) of summed batches."""
  return {**objectives.get(objective).summarize(sums), **router_metrics(sums)}


def train_step(spec: StepSpec, state: TrainState, frozen: dict, batch: dict) -> tuple[TrainState, dict]:
  rng, key = jax.random.split(state.rng)
  grads, sums = loss_and_grads(spec, state.params, frozen, batch, key)
  opt = make_optimizer(spec.optim)
  updates, opt_state = opt.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics = {**summarize(sums, spec.objective), "grad_norm": optax.tree.norm(grads),
             "lr": learning_rate(spec.optim)(state.step)}
  return TrainState(step=state.step + 1, params=params, opt_state=opt_state, rng=rng), metrics


def eval_sums(spec: StepSpec, trainable: dict, frozen: dict, batch: dict, key: jax.Array) -> dict:
  """Loss sums without dropout on a batch prepared with `key` (fixed per eval batch)."""
  with spec.traced_layout():
    return spec.obj.sums(spec, trainable, frozen, spec.obj.prepare(spec, key, batch), None)


@functools.lru_cache(maxsize=16)
def compiled_train_step(spec: StepSpec, mesh: Mesh, rules: sharding.Rules):
  """jit(train_step) with the state donated and laid out on `mesh`, the model traced in the rules' layout
  (so kernel calls run in shard_map); cached per (spec, mesh, rules)."""
  spec = spec.with_layout(mesh, rules)
  shardings = state_shardings(spec.models, spec.optim, mesh, rules)
  return jax.jit(functools.partial(train_step, spec), donate_argnums=0,
                 out_shardings=(shardings, sharding.replicated(mesh)))


@functools.lru_cache(maxsize=16)
def compiled_eval(spec: StepSpec, mesh: Mesh, rules: sharding.Rules):
  """jit(eval_sums), traced in the rules' layout exactly as the train step is."""
  spec = spec.with_layout(mesh, rules)
  return jax.jit(functools.partial(eval_sums, spec), out_shardings=sharding.replicated(mesh))
