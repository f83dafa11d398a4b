"""AdamW with the reference's defaults: betas (0.9, 0.95), weight decay 0.05, eps 1e-8, clip 1.0,
constant learning rate after an optional linear warm-up. Norm scales and biases are not decayed."""

from __future__ import annotations

import dataclasses

import jax
import optax


@dataclasses.dataclass(frozen=True)
class OptimSpec:
  lr: float = 1e-5
  warmup_steps: int = 0
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  weight_decay: float = 0.05
  clip: float = 1.0

  @classmethod
  def from_config(cls, optim) -> "OptimSpec":
    return cls(**{f.name: type(f.default)(optim[f.name]) for f in dataclasses.fields(cls)})


def learning_rate(spec: OptimSpec) -> optax.Schedule:
  if spec.warmup_steps <= 0:
    return optax.constant_schedule(spec.lr)
  return optax.warmup_constant_schedule(0.0, spec.lr, spec.warmup_steps)


def _decay_mask(params):
  """Decay matrices (and LoRA factors), not norm scales or biases."""
  def keep(path, _):
    name = jax.tree_util.keystr(path)
    return "norm" not in name and "bias" not in name
  return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(spec: OptimSpec) -> optax.GradientTransformation:
  """Pure function of the spec: the same spec builds the same transform in init, step and restore."""
  return optax.chain(
      optax.clip_by_global_norm(spec.clip),
      optax.adamw(learning_rate(spec), b1=spec.b1, b2=spec.b2, eps=spec.eps, weight_decay=spec.weight_decay,
                  mask=_decay_mask),
  )
