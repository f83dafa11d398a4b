"""Tiny random models whose every weight (norms and biases included) is non-trivial."""

import jax
import jax.numpy as jnp
from flax import nnx

from d2f_jax.models import LoraConfig, ModelConfig, Transformer


def random_model(config: ModelConfig, lora: LoraConfig | None = None, seed: int = 0) -> Transformer:
  model = Transformer(config, lora, rngs=nnx.Rngs(seed))
  state = nnx.state(model, nnx.Param)
  leaves, treedef = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.PRNGKey(seed + 1), len(leaves))
  new = []
  for key, leaf in zip(keys, leaves):
    noise = jax.random.normal(key, leaf.shape, jnp.float32)
    is_norm = leaf.ndim <= 2 and leaf.shape[-1] == config.embed_dim and jnp.all(leaf == 1)
    new.append((1.0 + 0.1 * noise if is_norm else leaf + 0.05 * noise).astype(leaf.dtype))
  nnx.update(model, jax.tree.unflatten(treedef, new))
  return model


def random_tokens(config: ModelConfig, batch: int, length: int, seed: int = 0):
  """Ids below the special tokens so masks / eos never appear by accident."""
  low = min(config.mask_token_id, config.eos_token_id, config.pad_token_id)
  return jax.random.randint(jax.random.PRNGKey(seed), (batch, length), 0, low, jnp.int32)
