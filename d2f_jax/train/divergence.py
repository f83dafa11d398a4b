"""The divergence guard: a non-finite loss, gradient norm or parameter stops training before that state is
saved or exported.

The first bad step is tracked on the device (`first_bad_step`), so the loop needs no host sync per step;
`check` reads it only where something is about to be logged, saved or exported.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


class NonFiniteError(RuntimeError):
  """A non-finite loss, gradient norm or parameter: training stopped without saving that state."""


@jax.jit
def first_bad_step(first_bad: jax.Array, step: jax.Array, metrics: dict) -> jax.Array:
  """The first step whose loss or gradient norm was not finite (-1: none yet)."""
  ok = jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"])
  return jnp.where((first_bad < 0) & ~ok, step, first_bad)


@jax.jit
def _all_finite(tree) -> jax.Array:
  leaves = [jnp.isfinite(x).all() for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


def check(first_bad: jax.Array, step: int, record: dict, params, *, check_params: bool, lr: float,
          newest_checkpoint: int | None) -> None:
  """Raise NonFiniteError if any step so far had a non-finite loss / gradient norm or (check_params) `params`
  hold a NaN / inf; the message names the step, the values, the learning rate and the newest checkpoint."""
  bad = int(jax.device_get(first_bad))
  finite_params = bool(jax.device_get(_all_finite(params))) if check_params or bad >= 0 else True
  if bad < 0 and finite_params:
    return
  values = ", ".join(f"{k}={record[k]:.4g}" for k in ("loss", "grad_norm") if k in record)
  where = f"step {bad} had a non-finite loss or gradient norm" if bad >= 0 else \
      f"the parameters after step {step} are not finite"
  raise NonFiniteError(
      f"training diverged: {where}{' (' + values + ')' if values else ''}, optim.lr={lr}. "
      f"Stopped at step {step} without saving a checkpoint or export of this state; the newest checkpoint is "
      f"{'step ' + str(newest_checkpoint) if newest_checkpoint is not None else 'none'}. "
      "Lower optim.lr or check the data.")
