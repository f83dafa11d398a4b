"""Token choice and confidence shared by every decoder.

Confidence is the probability of the chosen token under the temperature-scaled distribution *before*
top-p truncation: top-p only limits what may be sampled. (The PyTorch reference renormalises after top-p,
which pushes confidences toward 1 and makes tau_conf mean something different for every top_p; here
top_p -> 0 at temperature 1 is exactly greedy decoding.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from d2f_jax.decode.config import Knobs, per_row


def sampling_keep(scaled: jax.Array, log_total: jax.Array, top_p: jax.Array, top_k: jax.Array) -> jax.Array:
  """The tokens a draw may pick, from one descending sort of the scaled logits [..., V] (a sort over a 126k
  vocabulary per position is the filters' whole cost, so top-p and top-k share it):
  - top-p (nucleus): the most probable tokens until their mass reaches top_p (the first always);
  - top-k: the k highest (ties with the k-th kept too); k <= 0 keeps all.
  log_total: logsumexp [..., 1]; top_p, top_k: () or per row, broadcastable to [..., 1]. Returns bool [..., V].
  """
  size = scaled.shape[-1]
  ranked = -jnp.sort(-scaled, axis=-1)  # [..., V] descending
  ranked_probs = jnp.exp(ranked - log_total)  # the probabilities, sorted (exp is monotone)
  mass_before = jnp.cumsum(ranked_probs, axis=-1) - ranked_probs
  cutoff = jnp.min(jnp.where(mass_before <= top_p, ranked_probs, jnp.inf), axis=-1, keepdims=True)
  k = jnp.broadcast_to(jnp.clip(top_k, 1, size) - 1, scaled.shape[:-1] + (1,)).astype(jnp.int32)
  kth = jnp.take_along_axis(ranked, k, axis=-1)  # [..., 1] the k-th highest scaled logit
  return (jnp.exp(scaled - log_total) >= cutoff) & ((scaled >= kth) | (top_k <= 0))


def row_keys(key: jax.Array, batch: int) -> jax.Array:
  """Per-row PRNG keys [B]: row i of a batch decoded with `key` samples from fold_in(key, i), so a row's draws
  depend on its key and its own steps only, never on what else shares the batch. Given [B] keys, those."""
  if key.ndim == 1:
    return key
  return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(batch, dtype=jnp.uint32))


def split_rows(keys: jax.Array, sample: bool) -> tuple[jax.Array, jax.Array]:
  """Each row's key split once: (next keys [B], keys for this step's draws [B]). A greedy program draws
  nothing, so its keys are passed on unsplit (no per-row threefry in every step)."""
  if not sample:
    return keys, keys
  both = jax.vmap(jax.random.split)(keys)  # [B, 2]
  return both[:, 0], both[:, 1]


def argmax_first(x: jax.Array) -> jax.Array:
  """argmax over the last axis (first index on ties) as max + min-index: XLA:CPU's variadic argmax
  reduction is several times slower than these two plain reductions, and this sits in every step."""
  top = jnp.max(x, axis=-1, keepdims=True)
  size = x.shape[-1]
  first = jnp.min(jnp.where(x == top, jnp.arange(size, dtype=jnp.int32), size), axis=-1)
  return jnp.minimum(first, size - 1)  # an all-NaN row yields the last index, not out of range


def choose_tokens(logits: jax.Array, key: jax.Array, knobs: Knobs, sample: bool):
  """Chosen ids and their confidence for logits [..., V] (fp32).

  Greedy takes the argmax; sampling draws from softmax(logits / temperature) restricted to top-k and top-p. With
  `sample`, a row whose temperature is 0 still takes the argmax of the unscaled logits, bit for bit what a
  greedy decode computes (knobs may be per row: logits' first axis is the batch).
  key: one key, or one per row ([B], `row_keys`: each row draws from its own).
  Returns (ids [...] int32, confidence [...] f32, scaled logits [..., V] for `ordering_score`).
  """
  scaled = logits.astype(jnp.float32)
  if sample:
    temperature = per_row(knobs.temperature, logits.ndim)  # () or [B, 1, ...]
    scaled = scaled / jnp.where(temperature <= 0.0, 1.0, temperature)
  top = jnp.max(scaled, axis=-1, keepdims=True)
  log_total = top + jnp.log(jnp.sum(jnp.exp(scaled - top), axis=-1, keepdims=True))  # logsumexp [..., 1]
  ids = argmax_first(scaled)
  if sample:
    keep = sampling_keep(scaled, log_total, per_row(knobs.top_p, logits.ndim), per_row(knobs.top_k, logits.ndim))
    allowed = jnp.where(keep, scaled, -jnp.inf)
    if key.ndim == 1:  # per row
      drawn = jax.vmap(lambda k, row: jax.random.categorical(k, row, axis=-1))(key, allowed)
    else:
      drawn = jax.random.categorical(key, allowed, axis=-1)
    ids = jnp.where(per_row(knobs.temperature, logits.ndim - 1) <= 0.0, ids, drawn)
  ids = ids.astype(jnp.int32)
  chosen = jnp.take_along_axis(scaled, ids[..., None], axis=-1)
  return ids, jnp.exp(chosen - log_total)[..., 0], scaled


def ordering_score(alg: str, confidence: jax.Array, scaled: jax.Array) -> jax.Array:
  """Dream's unmasking order, higher first: top-1 'confidence', top1 - top2 'margin', or -entropy."""
  if alg == "confidence":
    return confidence
  logp = jax.nn.log_softmax(scaled, axis=-1)
  probs = jnp.exp(logp)
  if alg == "margin":
    top2 = jax.lax.top_k(probs, 2)[0]  # [..., 2]
    return top2[..., 0] - top2[..., 1]
  if alg == "entropy":
    return jnp.sum(jnp.where(probs > 0, probs * logp, 0.0), axis=-1)
  raise ValueError(f"unknown ordering alg {alg!r}")


def is_stop(tokens: jax.Array, stop_ids: jax.Array) -> jax.Array:
  """tokens [B, ...] -> bool [B, ...]: token is one of the stop ids [K] (or [B, K], per row); -1 slots never
  match."""
  if stop_ids.ndim == 2:  # [B, K] -> [B, 1, ..., K]
    stop_ids = stop_ids.reshape(stop_ids.shape[:1] + (1,) * (tokens.ndim - 1) + stop_ids.shape[1:])
  return jnp.any(tokens[..., None] == stop_ids, axis=-1)


def rank_descending(score: jax.Array) -> jax.Array:
  """Rank of each entry along the last axis when sorted by descending score, ties by position."""
  order = jnp.argsort(-score, axis=-1, stable=True)
  return jnp.argsort(order, axis=-1, stable=True)
