"""The router's load while training a mixture-of-experts model (LLaDA2): the trained model's forward reports
the tokens each expert of each expert layer took; the step sums them over micro batches and shards (the
sums' 'expert_load' [L, X]) and logs two numbers per step. The router itself stays frozen (not a LoRA
target), so these watch how the adapted attention moves the routing, not a balancing loss."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from d2f_jax.models import Transformer


def trained_hidden(model: Transformer, tokens, positions, ids, *, dropout_key=None) -> tuple[jax.Array, dict]:
  """(final hidden states [B, T, E], sums to add: {'expert_load': [L, X]} for a model with experts)."""
  if model.config.moe is None:
    hidden, _ = model.hidden_states(tokens, positions, ids, dropout_key=dropout_key)
    return hidden, {}
  hidden, _, load = model.hidden_states(tokens, positions, ids, dropout_key=dropout_key, router_load=True)
  return hidden, {} if load is None else {"expert_load": load}


def router_metrics(sums: dict) -> dict:
  """'router_max_load': the busiest expert's share of its layer's tokens times the number of experts,
  averaged over layers (1 = perfectly even); 'router_unused': the share of (layer, expert) pairs that took
  no token. Empty without experts."""
  if "expert_load" not in sums:
    return {}
  load = sums["expert_load"]  # [L, X]
  share = load / jnp.maximum(load.sum(axis=-1, keepdims=True), 1.0)
  return {"router_max_load": jnp.mean(share.max(axis=-1)) * load.shape[-1],
          "router_unused": jnp.mean((load == 0).astype(jnp.float32))}
