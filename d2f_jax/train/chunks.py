"""Per-token losses from final hidden states, a chunk of sequence rows at a time.

Logits are formed inside `jax.checkpoint`ed chunks, so the [B, T, V] fp32 buffers of an 8B vocabulary never
exist whole, in the forward or the backward pass: each chunk's logits are recomputed when its gradient is
needed. Every objective's loss goes through `map_row_chunks`.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


def map_row_chunks(fn: Callable, xs: tuple, chunk: int):
  """fn over [B, C, ...] slices of the arrays `xs` (each [B, T, ...]), C = `chunk` rows (0: all T at once).

  fn returns a pytree of [B, C, ...] arrays; the result is the same pytree with the chunks put back to
  [B, T, ...]. T must be a multiple of `chunk`.
  """
  batch, length = xs[0].shape[:2]
  chunk = length if chunk <= 0 else chunk
  n = length // chunk
  one = jax.checkpoint(fn)  # recompute a chunk's logits in the backward pass instead of keeping them
  if n == 1:
    return one(xs)
  split = lambda h: h.reshape(batch, n, chunk, *h.shape[2:]).swapaxes(0, 1)  # [n, B, C, ...]  # noqa: E731
  out = jax.lax.map(one, jax.tree.map(split, xs))
  merge = lambda x: x.swapaxes(0, 1).reshape(batch, length, *x.shape[3:])  # noqa: E731
  return jax.tree.map(merge, out)


def cross_entropy(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(CE of the target ids, whether the arg-max is the target) for logits [..., V] and targets [...]; fp32."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  ce = -jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
  correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
  return ce, correct


def token_cross_entropy(model, hidden: jax.Array, targets: jax.Array, chunk: int) -> tuple[jax.Array, jax.Array]:
  """(CE [B, T], correct [B, T]) of `model`'s logits from hidden states [B, T, E] against targets [B, T]."""
  return map_row_chunks(lambda xs: cross_entropy(model.logits_from_hidden(xs[0]), xs[1]), (hidden, targets), chunk)
