"""LLaDA's masked-diffusion objective: pre-training / SFT of the bidirectional base (the teacher of D2F).

Per row a noise level t ~ U(eps, 1); every response token is masked iid with probability t (the prompt
stays clean; right-padding EOS is response, as in LLaDA's SFT, so the model learns to stop). The model sees
the noised row bidirectionally and the loss is

  loss = sum_{masked} CE(logits, clean token) / t  /  #response tokens in the global batch,

an unbiased estimate of the negative ELBO per response token (LLaDA's SFT estimator; with no prompt it is
the pre-training one). Dream's logit shift is applied when the model has it.

`semi_ar` > 0 mixes in, for that fraction of rows, the states a semi-autoregressive decoder visits: the
response before a uniformly drawn cut is clean, the `window` positions from the cut are masked with
probability t, everything after them is masked (weight 1: their t is 1). Still an MDM loss on masked
tokens; a model trained for minutes does not generalize from iid masks to a long all-masked suffix,
which a block-by-block decode of a long answer starts every block from (the long miniature's teacher).
`suffix_weight` scales the loss on that all-masked suffix (1: the MDM weight; 0: the loss is the window's
alone, as block-diffusion training takes it, so the far, unpredictable tokens add no gradient noise). The
loss stays a sum over the response tokens' count (so it is not comparable across suffix weights), and the
masked count and accuracy still include the suffix.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from d2f_jax.models import Transformer, align_logits, attention_ids
from d2f_jax.train.chunks import token_cross_entropy
from d2f_jax.train.router_stats import trained_hidden


@flax.struct.dataclass
class MdmNoised:
  tokens: jax.Array  # [B, T] int32, masked positions replaced by the mask id
  clean: jax.Array  # [B, T] int32, the original tokens (the targets)
  masked: jax.Array  # [B, T] bool, True where the loss is taken
  weight: jax.Array  # [B, T] float32, 1 / t on masked positions, 0 elsewhere
  response: jax.Array  # [B, T] bool, False on the prompt
  t: jax.Array  # [B] float32, the row's mask probability


def noise_mdm(key: jax.Array, tokens: jax.Array, prompt_len: jax.Array, *, eps: float,
              mask_token_id: int, semi_ar: float = 0.0, window: int = 32, suffix_weight: float = 1.0) -> MdmNoised:
  """Mask the response of `tokens` [B, T] (from prompt_len [B] on) with a per-row ratio t ~ U(eps, 1).

  t = eps + (1 - eps) u with u = uniform(t_key, [B]); a position is masked iff uniform(mask_key, [B, T]) < t,
  where (t_key, mask_key) = split(key): a test can redraw the same mask from the same key. With `semi_ar` > 0
  (module docstring) a third and fourth key draw which rows are semi-autoregressive and their cuts.
  """
  batch, length = tokens.shape
  t_key, mask_key = jax.random.split(key)
  t = eps + (1.0 - eps) * jax.random.uniform(t_key, (batch,), jnp.float32)  # [B]
  positions = jnp.arange(length, dtype=jnp.int32)[None, :]  # [1, T]
  prompt_len = prompt_len.astype(jnp.int32)[:, None]  # [B, 1]
  response = positions >= prompt_len  # [B, T]
  p = jnp.broadcast_to(t[:, None], (batch, length))  # [B, T] each position's mask probability
  scale = jnp.ones((batch, length), jnp.float32)  # [B, T] the loss weight's factor (suffix_weight after windows)
  if semi_ar > 0.0:
    row_key, cut_key = jax.random.split(jax.random.fold_in(key, 1))
    chosen = jax.random.uniform(row_key, (batch, 1)) < semi_ar  # [B, 1]
    cut = prompt_len + jnp.floor(jax.random.uniform(cut_key, (batch, 1)) * (length - prompt_len)).astype(jnp.int32)
    staged = jnp.where(positions < cut, 0.0, jnp.where(positions < cut + window, t[:, None], 1.0))  # [B, T]
    p = jnp.where(chosen, staged, p)
    scale = jnp.where(chosen & (positions >= cut + window), suffix_weight, 1.0)
  masked = response & (jax.random.uniform(mask_key, (batch, length), jnp.float32) < p)
  weight = jnp.where(masked, scale / jnp.maximum(p, eps), 0.0)  # [B, T]
  return MdmNoised(tokens=jnp.where(masked, mask_token_id, tokens).astype(jnp.int32), clean=tokens.astype(jnp.int32),
                   masked=masked, weight=weight, response=response, t=t)


def mdm_sums(model: Transformer, noised: MdmNoised, *, dropout_key: jax.Array | None = None,
             chunk: int = 0) -> dict[str, jax.Array]:
  """Sums over the batch (microbatches and shards add up exactly): 'ce' (sum of CE / t over masked
  positions, the differentiated numerator), 'response' (its denominator), 'masked', 'correct'."""
  batch, length = noised.tokens.shape
  positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))  # [B, T]
  hidden, router = trained_hidden(model, noised.tokens, positions, attention_ids(positions, "bidirectional"),
                                  dropout_key=dropout_key)  # [B, T, E]
  hidden = align_logits(hidden, model.config)  # Dream: row i takes output i - 1 (row-wise, so on hidden states)
  ce, correct = token_cross_entropy(model, hidden, noised.clean, chunk)  # [B, T]
  masked = noised.masked.astype(jnp.float32)
  return {"ce": jnp.sum(jax.lax.stop_gradient(noised.weight) * ce), "masked": jnp.sum(masked),
          "correct": jnp.sum(masked * correct), "response": jnp.sum(noised.response.astype(jnp.float32)), **router}


def summarize(sums: dict) -> dict:
  response, masked = jnp.maximum(sums["response"], 1.0), jnp.maximum(sums["masked"], 1.0)
  return {"loss": sums["ce"] / response, "mask_rate": sums["masked"] / response, "accuracy": sums["correct"] / masked}
