"""The compiled window widths of the d2f decoder: which forward shapes one decode loop holds.

A step runs the narrowest compiled width that holds every live row's window (`lax.switch` inside the jitted
loop), so the set trades compile time for what a step pays on a compute-bound device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def window_widths_for(widths: tuple[int, ...] | None, window_blocks: int) -> tuple[int, ...]:
  """The sorted compiled widths (blocks) for a largest window of `window_blocks`: `widths` (default 1 to 4,
  then 1 + 2^k) cut to the largest window, which is always included.

  Dense where most steps run: on a compute-bound device (a CPU) a step pays for its compiled width, and
  rounding a 4-block window up to 5 cost the miniature's D2F decode 13 % of its tokens/s."""
  if widths is None:
    widths = (1, 2, 3, 4) + tuple(1 + 2 ** k for k in range(max(window_blocks, 1).bit_length()))
  return tuple(sorted({w for w in widths if w < window_blocks} | {window_blocks}))


def query_widths_for(block_size: int, window_widths: tuple[int, ...]) -> tuple[int, ...]:
  """Compiled forward widths (positions) of the query-limited d2f step: every multiple of half a block up to
  four blocks, where most steps run, then the block widths; the largest window last. Such a step feeds whole
  finished blocks plus each block's decided positions and q masks, so its positions rarely fill whole
  blocks; the limit q is a traced knob, so the widths cannot depend on it."""
  largest = window_widths[-1] * block_size
  grain = max(block_size // 2, 1)
  fine = range(grain, min(4 * block_size, largest) + 1, grain)
  return tuple(sorted({*fine, *(w * block_size for w in window_widths)}))


def ms_at_width(ms_by_width: dict[int, float], blocks: float) -> float:
  """ms of a forward at a mean window of `blocks` blocks, from ms at compiled widths: linear between the
  widths around it (a decode mixes those widths), clamped to the compiled range (the one interpolation of
  bench cost's projections and the miniature's CPU ceiling)."""
  widths = sorted(ms_by_width)
  blocks = min(max(blocks, widths[0]), widths[-1])
  below = max(w for w in widths if w <= blocks)
  above = min(w for w in widths if w >= blocks)
  if above == below:
    return ms_by_width[below]
  t = (blocks - below) / (above - below)
  return (1 - t) * ms_by_width[below] + t * ms_by_width[above]


def narrowest(widths: tuple[int, ...], needed: jax.Array) -> jax.Array:
  """() int32: the index of the narrowest of the sorted compiled `widths` holding `needed` (the widest when
  none does), the `lax.switch` index of a step."""
  return jnp.minimum(jnp.sum(jnp.asarray(widths, jnp.int32) < needed), len(widths) - 1).astype(jnp.int32)
