"""Noising a batch for distillation: the prompt stays clean, response block i is masked iid with ratio p_i.

The response starts at each row's prompt length and runs to the end of the row: right padding (EOS) is
response too, so the student learns where answers stop.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from d2f_jax.train.schedule import Schedule, block_ratios


@flax.struct.dataclass
class Noised:
  tokens: jax.Array  # [B, T] int32, masked positions replaced by the mask id
  masked: jax.Array  # [B, T] bool, True where the loss is taken
  weight: jax.Array  # [B, T] float32, 1 / p_i on masked positions, 0 elsewhere
  block: jax.Array  # [B, T] int32, response block index, -1 on the prompt
  response: jax.Array  # [B, T] bool, False on the prompt


def response_blocks(prompt_len: jax.Array, length: int, block_size: int) -> tuple[jax.Array, jax.Array]:
  """(block index [B, T] with -1 on the prompt, number of response blocks [B])."""
  positions = jnp.arange(length, dtype=jnp.int32)[None, :]  # [1, T]
  prompt_len = prompt_len.astype(jnp.int32)[:, None]  # [B, 1]
  block = jnp.where(positions >= prompt_len, (positions - prompt_len) // block_size, -1)  # [B, T]
  num_blocks = -(-(length - prompt_len[:, 0]) // block_size)  # [B], ceil
  return block, num_blocks


def noise_batch(key: jax.Array, tokens: jax.Array, prompt_len: jax.Array, *, block_size: int, schedule: Schedule,
                mask_token_id: int) -> Noised:
  """Mask each response block of `tokens` [B, T] with its scheduled ratio; prompt_len [B]."""
  batch, length = tokens.shape
  ratio_key, mask_key = jax.random.split(key)
  block, num_blocks = response_blocks(prompt_len, length, block_size)
  max_blocks = -(-length // block_size)
  ratios = block_ratios(ratio_key, num_blocks, max_blocks, schedule)  # [B, N]
  response = block >= 0
  p = jnp.take_along_axis(ratios, jnp.maximum(block, 0), axis=1)  # [B, T]
  masked = response & (jax.random.uniform(mask_key, (batch, length), jnp.float32) < p)
  return Noised(tokens=jnp.where(masked, mask_token_id, tokens).astype(jnp.int32), masked=masked,
                weight=jnp.where(masked, 1.0 / p, 0.0), block=block, response=response)
