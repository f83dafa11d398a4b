"""Next-token prediction: the same-size autoregressive baseline.

Causal attention; output row i predicts token i + 1 from raw logits, whatever the family's logit
convention (that is how decode's `ar` baseline reads the model). Targets are the response tokens up to and
including the row's FIRST EOS at or after the prompt: the answer and its stop token. Later EOS padding is
not a target: AR decoding stops at the first EOS and never sees it, and counting it would dilute the loss
with trivially predictable tokens (the mean would depend on how much padding a row has).

  loss = sum_{targets} CE(logits[i - 1], token[i]) / #targets in the global batch
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from d2f_jax.models import Transformer, attention_ids
from d2f_jax.train.chunks import token_cross_entropy
from d2f_jax.train.router_stats import trained_hidden


def target_mask(tokens: jax.Array, prompt_len: jax.Array, eos_token_id: int) -> jax.Array:
  """[B, T] bool over token positions j: True for prompt_len <= j <= first EOS at or after the prompt (all
  of the response when it has no EOS), never j = 0 (no row precedes it)."""
  batch, length = tokens.shape
  j = jnp.arange(length, dtype=jnp.int32)[None, :]  # [1, T]
  start = jnp.maximum(prompt_len.astype(jnp.int32), 1)[:, None]  # [B, 1]
  is_eos = (tokens == eos_token_id) & (j >= start)  # [B, T]
  first_eos = jnp.where(is_eos.any(axis=1), jnp.argmax(is_eos, axis=1), length)[:, None]  # [B, 1]
  return (j >= start) & (j <= first_eos)


def ar_sums(model: Transformer, tokens: jax.Array, targets: jax.Array, *, dropout_key: jax.Array | None = None,
            chunk: int = 0) -> dict[str, jax.Array]:
  """Sums over the batch: 'ce' (sum of next-token CE over target positions), 'targets' (its denominator),
  'correct'. tokens [B, T]; targets [B, T] bool from `target_mask`."""
  batch, length = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))  # [B, T]
  hidden, router = trained_hidden(model, tokens, positions, attention_ids(positions, "causal"), dropout_key=dropout_key)
  # Row i predicts token i + 1: shift targets left; the last row has no next token (weight 0).
  next_tokens = jnp.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)  # [B, T]
  weight = jnp.concatenate([targets[:, 1:], jnp.zeros_like(targets[:, :1])], axis=1).astype(jnp.float32)
  ce, correct = token_cross_entropy(model, hidden, next_tokens, chunk)  # [B, T]
  return {"ce": jnp.sum(weight * ce), "targets": jnp.sum(weight), "correct": jnp.sum(weight * correct), **router}


def summarize(sums: dict) -> dict:
  count = jnp.maximum(sums["targets"], 1.0)
  return {"loss": sums["ce"] / count, "accuracy": sums["correct"] / count}
