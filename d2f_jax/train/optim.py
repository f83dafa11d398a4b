"""AdamW with the reference's defaults: betas (0.9, 0.95), weight decay 0.05, eps 1e-8, clip 1.0,
constant learning rate after an optional linear warm-up (the reference's schedule, the default); `decay`
'cosine' or 'linear' anneals it to 0 at `decay_steps` instead, the usual choice for short from-scratch runs
(the miniature's). Norm scales and biases are not weight-decayed."""

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
  decay: str = "constant"  # after warm-up: 'constant' (the reference), 'cosine' or 'linear' to 0 at decay_steps
  decay_steps: int = 0  # the run's total steps (from the config's total_steps)

  @classmethod
  def from_config(cls, optim, total_steps: int = 0) -> "OptimSpec":
    fields = {f.name: type(f.default)(optim[f.name]) for f in dataclasses.fields(cls)
              if f.name in optim and f.name != "decay_steps"}
    return cls(**fields, decay_steps=int(total_steps))


DECAYS = ("constant", "cosine", "linear")


def learning_rate(spec: OptimSpec) -> optax.Schedule:
  if spec.decay not in DECAYS:
    raise ValueError(f"optim.decay={spec.decay!r}: expected one of {DECAYS}")
  warmup = max(spec.warmup_steps, 0)
  if spec.decay == "constant":
    if warmup == 0:
      return optax.constant_schedule(spec.lr)
    return optax.warmup_constant_schedule(0.0, spec.lr, warmup)
  if spec.decay_steps <= warmup:
    raise ValueError(f"optim.decay={spec.decay!r} needs total_steps ({spec.decay_steps}) > optim.warmup_steps "
                     f"({warmup})")
  anneal = (optax.cosine_decay_schedule(spec.lr, spec.decay_steps - warmup) if spec.decay == "cosine"
            else optax.linear_schedule(spec.lr, 0.0, spec.decay_steps - warmup))
  return optax.join_schedules([optax.linear_schedule(0.0, spec.lr, warmup), anneal], [warmup])


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
