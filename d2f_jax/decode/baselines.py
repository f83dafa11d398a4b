"""Baselines on the same init / step / finish contract as D2F: LLaDA vanilla, Dream vanilla, cached AR.

- vanilla (LLaDA): the whole sequence, bidirectional, no cache; the response is cut into blocks decoded
  left to right, `steps / num_blocks` steps per block, each step unmasking the k most confident masked
  positions of the current block (k from LLaDA's even split of the block over its steps).
- dream_vanilla: the whole response at once; step i unmasks int(m * (1 - s_{i+1} / s_i)) of the m masked
  positions (s = linspace(1, 1e-3, steps + 1), all of them at the last step), ordered by `alg`. The count
  is per row (Dream averages it over the batch, which would make rows depend on each other).
- ar: prefill the prompt causally into the cache, then one token per forward from the last row's raw
  logits (a standard causal LM, whatever the family's logit convention), stopping per row.
Neither vanilla method stops early: their schedule is fixed; the result is cut at the first stop token.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from d2f_jax.decode.config import DecodeSpec, Knobs
from d2f_jax.decode.result import DecodeResult, decoded_prefix, make_result
from d2f_jax.decode.sampling import choose_tokens, is_stop, ordering_score, rank_descending, row_keys, split_rows
from d2f_jax.models import PAD_ID, KVCache, align_logits

DREAM_EPS = 1e-3


@flax.struct.dataclass
class FullState:
  """Loop state of the no-cache baselines: the whole sequence is recomputed every step."""

  tokens: jax.Array  # [B, P + N] int32
  prompt_len: jax.Array  # [B] int32
  trace: jax.Array  # [B, N] int32
  key: jax.Array
  t: jax.Array  # () int32 steps taken


def llada_transfer_counts(block_size: int, steps_per_block: int) -> np.ndarray:
  """Tokens unmasked at each step of a block [steps_per_block]: an even split, remainder first."""
  base, extra = divmod(block_size, steps_per_block)
  return np.array([base + (i < extra) for i in range(steps_per_block)], np.int32)


def dream_transfer_counts(max_masks: int, steps: int) -> np.ndarray:
  """Table [steps, max_masks + 1]: tokens Dream unmasks at step i when m positions are masked."""
  times = np.linspace(1.0, DREAM_EPS, steps + 1)
  table = np.zeros((steps, max_masks + 1), np.int32)
  for i in range(steps):
    for m in range(max_masks + 1):
      table[i, m] = m if i == steps - 1 else int(m * (1 - times[i + 1] / times[i]))
  return table


def _full_sequence_logits(model, state: FullState, spec: DecodeSpec) -> jax.Array:
  """Aligned logits [B, N, V] of the response under bidirectional attention over prompt + response."""
  width = state.tokens.shape[1] - spec.max_new_tokens
  cols = jnp.arange(state.tokens.shape[1], dtype=jnp.int32)[None, :]
  valid = cols >= (width - state.prompt_len)[:, None]  # [B, P + N]
  positions = jnp.maximum(cols - (width - state.prompt_len)[:, None], 0)
  ids = jnp.where(valid, 0, PAD_ID).astype(jnp.int32)
  hidden, _ = model.hidden_states(state.tokens, positions, ids)  # [B, P + N, E]
  raw = model.logits_from_hidden(hidden[:, width - 1:])  # [B, 1 + N, V]: the head only where used
  return align_logits(raw[:, 1:], spec.model, previous=raw[:, 0])


def init_full(model, prompt, prompt_len, key, knobs: Knobs, spec: DecodeSpec) -> FullState:
  del model, knobs
  batch = prompt.shape[0]
  response = jnp.full((batch, spec.max_new_tokens), spec.model.mask_token_id, jnp.int32)
  return FullState(tokens=jnp.concatenate([prompt.astype(jnp.int32), response], axis=1),
                   prompt_len=prompt_len.astype(jnp.int32),
                   trace=jnp.full((batch, spec.max_new_tokens), -1, jnp.int32), key=key, t=jnp.int32(0))


def step_full(model, state: FullState, knobs: Knobs, spec: DecodeSpec) -> FullState:
  """One forward and one unmasking round of vanilla (LLaDA) or dream_vanilla."""
  n = spec.max_new_tokens
  width = state.tokens.shape[1] - n
  key, sub = jax.random.split(state.key)
  choice, confidence, scaled = choose_tokens(_full_sequence_logits(model, state, spec), sub, knobs, spec.sample)
  response = state.tokens[:, width:]  # [B, N]
  masked = response == spec.model.mask_token_id
  if spec.method == "vanilla":
    per_block = spec.steps // spec.num_blocks
    counts = jnp.asarray(llada_transfer_counts(spec.block_size, per_block))
    block = state.t // per_block
    in_block = jnp.arange(n)[None, :] // spec.block_size == block
    candidate = masked & in_block
    score = confidence
    take = jnp.broadcast_to(counts[state.t % per_block], masked.shape[:1])  # [B]
  else:
    table = jnp.asarray(dream_transfer_counts(n, spec.steps))
    candidate = masked
    score = ordering_score(spec.alg, confidence, scaled)
    take = table[state.t, masked.sum(axis=1)]  # [B]
  rank = rank_descending(jnp.where(candidate, score, -jnp.inf))  # [B, N]
  accept = candidate & (rank < take[:, None])
  response = jnp.where(accept, choice, response)
  trace = jnp.where(accept, state.t, state.trace)
  return state.replace(tokens=state.tokens.at[:, width:].set(response), trace=trace, key=key, t=state.t + 1)


def running_full(state: FullState, spec: DecodeSpec) -> jax.Array:
  return state.t < spec.steps


def finish_full(state: FullState, knobs: Knobs, spec: DecodeSpec) -> DecodeResult:
  width = state.tokens.shape[1] - spec.max_new_tokens
  forwards = jnp.full(state.prompt_len.shape, state.t, jnp.int32)
  return make_result(state.tokens[:, width:], state.trace, knobs.stop_ids, spec.model.pad_token_id, forwards)


@flax.struct.dataclass
class ARState:
  tokens: jax.Array  # [B, P + N] int32, pad id after a row stops
  prompt_len: jax.Array  # [B] int32
  cache: KVCache  # [L, B, P + N, K, D]
  done: jax.Array  # [B] bool
  forwards: jax.Array  # [B] int32
  trace: jax.Array  # [B, N] int32
  key: jax.Array  # [B] one PRNG key per row (sampling.row_keys)
  t: jax.Array  # () int32 tokens produced so far; [B] when rows started at different times (the engine)


def _ar_emit(state: ARState, logits: jax.Array, knobs: Knobs, spec: DecodeSpec) -> ARState:
  """Choose the token after the last one from raw logits [B, V] and write it at response index t."""
  key, sub = split_rows(state.key, spec.sample)
  choice, _, _ = choose_tokens(logits, sub, knobs, spec.sample)  # [B]
  live = ~state.done
  token = jnp.where(live, choice, spec.model.pad_token_id)
  width = state.tokens.shape[1] - spec.max_new_tokens
  rows = jnp.arange(token.shape[0])
  t = jnp.broadcast_to(state.t, token.shape)  # [B]; past the response (a frozen row) the writes drop
  tokens = state.tokens.at[rows, width + t].set(token, mode="drop")
  trace = state.trace.at[rows, t].set(jnp.where(live, t, -1), mode="drop")
  return state.replace(tokens=tokens, trace=trace, key=key, t=state.t + 1, forwards=state.forwards + live,
                       done=state.done | (live & is_stop(choice, knobs.stop_ids)))


def init_ar(model, prompt, prompt_len, key, knobs: Knobs, spec: DecodeSpec) -> ARState:
  """Prefill the prompt with causal ids; its last row gives the first token."""
  batch, width = prompt.shape
  cols = jnp.arange(width, dtype=jnp.int32)[None, :]
  pad = (width - prompt_len)[:, None]
  positions = jnp.maximum(cols - pad, 0)
  ids = jnp.where(cols >= pad, positions, PAD_ID).astype(jnp.int32)
  cache = KVCache.init(spec.model, batch, width + spec.max_new_tokens)
  hidden, (k, v) = model.hidden_states(prompt.astype(jnp.int32), positions, ids, cache)  # [B, P, E]
  cache = cache.write(k, v, ids, jnp.full((batch,), width, jnp.int32))
  raw = model.logits_from_hidden(hidden[:, -1:])  # [B, 1, V]
  response = jnp.full((batch, spec.max_new_tokens), spec.model.pad_token_id, jnp.int32)
  state = ARState(tokens=jnp.concatenate([prompt.astype(jnp.int32), response], axis=1),
                  prompt_len=prompt_len.astype(jnp.int32), cache=cache, done=jnp.zeros((batch,), bool),
                  forwards=jnp.zeros((batch,), jnp.int32),
                  trace=jnp.full((batch, spec.max_new_tokens), -1, jnp.int32), key=row_keys(key, batch),
                  t=jnp.int32(0))
  return _ar_emit(state, raw[:, -1], knobs, spec)


def step_ar(model, state: ARState, knobs: Knobs, spec: DecodeSpec) -> ARState:
  """Feed the last token (position prompt_len + t - 1) against the cache; emit the next one."""
  width = state.tokens.shape[1] - spec.max_new_tokens
  t = jnp.broadcast_to(state.t, state.prompt_len.shape)  # [B]
  last = jnp.take_along_axis(state.tokens, (width + t - 1)[:, None], axis=1)  # [B, 1]
  positions = (state.prompt_len + t - 1)[:, None]
  raw, (k, v) = model(last, positions, positions, state.cache)
  cache = state.cache.write(k, v, positions, jnp.ones_like(state.prompt_len))
  return _ar_emit(state.replace(cache=cache), raw[:, 0], knobs, spec)


def running_ar(state: ARState, spec: DecodeSpec) -> jax.Array:
  return jnp.any(~state.done) & (state.t < spec.max_new_tokens)


def finish_ar(state: ARState, knobs: Knobs, spec: DecodeSpec) -> DecodeResult:
  width = state.tokens.shape[1] - spec.max_new_tokens
  return make_result(state.tokens[:, width:], state.trace, knobs.stop_ids, spec.model.pad_token_id,
                     state.forwards)


def settled_full(state: FullState, spec: DecodeSpec) -> list[int]:
  """Row 0's decoded response prefix (no mask before it), on the host."""
  return decoded_prefix(state.tokens[0, state.tokens.shape[1] - spec.max_new_tokens:], spec.model.mask_token_id)


def settled_ar(state: ARState, spec: DecodeSpec) -> list[int]:
  """Row 0's first `t` response tokens, on the host."""
  width = state.tokens.shape[1] - spec.max_new_tokens
  return np.asarray(state.tokens[0, width:width + int(np.asarray(state.t).reshape(-1)[0])]).tolist()
