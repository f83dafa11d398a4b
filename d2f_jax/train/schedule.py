"""Per-block mask ratios: D2F's monotone schedule and the random-ratio ablation.

Later blocks are noisier than earlier ones in the monotone schedule, which is what block-causal decoding
meets at inference: a block is still mostly masked while its predecessors are nearly done.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

SCHEDULES = ("monotone", "random")


@dataclasses.dataclass(frozen=True)
class Schedule:
  """kind: 'monotone' (reference) or 'random' (ablation); ratios lie in [low, high]."""

  kind: str = "monotone"
  low: float = 0.2
  high: float = 0.7

  def __post_init__(self):
    if self.kind not in SCHEDULES:
      raise ValueError(f"Schedule.kind must be one of {SCHEDULES}, got {self.kind!r}")
    if not 0.0 < self.low <= self.high <= 1.0:
      raise ValueError(f"Schedule needs 0 < low <= high <= 1, got low={self.low}, high={self.high}")


def block_ratios(key: jax.Array, num_blocks: jax.Array, max_blocks: int, schedule: Schedule) -> jax.Array:
  """Mask ratio of every response block, [B, max_blocks] float32.

  num_blocks: [B] int, the blocks each row's response really has; entries past it are unused.
  monotone: p0 = low + U (high - low); inc_j = U_j (high - p0) / (N - 1); p_i = min(1, p0 + sum_{j<i} inc_j),
  which for (low, high) = (0.2, 0.7) is the reference p0 = U/2 + 0.2, inc_j = U_j (0.7 - p0) / (N - 1).
  random: p_i ~ U(low, high) iid per block.
  """
  batch = num_blocks.shape[0]
  k0, k1 = jax.random.split(key)
  span = schedule.high - schedule.low
  if schedule.kind == "random":
    return schedule.low + span * jax.random.uniform(k1, (batch, max_blocks), jnp.float32)
  p0 = schedule.low + span * jax.random.uniform(k0, (batch,), jnp.float32)  # [B]
  steps = jnp.maximum(num_blocks - 1, 1).astype(jnp.float32)  # [B]
  inc = jax.random.uniform(k1, (batch, max_blocks), jnp.float32) * ((schedule.high - p0) / steps)[:, None]
  before = jnp.cumsum(inc, axis=1) - inc  # [B, N]: sum_{j<i} inc_j
  return jnp.minimum(1.0, p0[:, None] + before)
