"""LLaDA2's own block-diffusion sampler (the released checkpoints' `generate`), batched and jitted, on the
init / step / finish contract of the other decoders: method 'llada2'.

Blocks are aligned to absolute position 0 (block b holds positions [b * B, (b + 1) * B)); the prompt is not
padded, so the first block decoded is the one holding the prompt's end, its prompt part fixed. Attention is
block-diffusion: a key is visible iff its block <= the query's. Each step recomputes the sequence (no cache,
as the released loop) and, in the row's current block, accepts every masked position whose confidence
exceeds tau_conf (strictly), or, when fewer than the schedule's count for this step do, the count most
confident ones (an even split of the block over `steps` steps, remainder first). A block ends when it has no
mask left or after `steps` steps; a row stops after a block when its response so far holds a stop id, or
after the block holding position prompt_len + max_new_tokens - 1. Rows are independent (each at its own
block and step), so a row decodes as it would alone.

With `editing_threshold` (LLaDA2.1's released loop, `spec.editing`): a step accepts the masks above tau_conf,
else the one most confident (no schedule), and in the same forward rewrites every decided response token of
the block whose choice differs with a probability above the editing threshold (token-to-token editing; the
prompt's part is never rewritten). A block ends after a step that began with no mask and edited nothing, or
before the forward that would be its (max_post_steps + 1)-th to begin with no mask. The mask token is never
chosen there (its logit is -inf; a trained model gives it ~0): the released loop, which has no step cap while
masks remain, would re-decode a chosen mask forever.

With `block_cache` (`spec.block_cache`, a speed option): block-causal attention makes a finished block's K/V
exact, so they are cached, and a step feeds only the previous block (whose K/V it appends once the current
block is over) and the current one: 2 x block positions a step instead of the whole sequence. The same
attention, summed in another order: greedy tokens equal the released loop's but for float near-ties; a
sampling run draws from other random numbers (the draws are over the fed positions).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from d2f_jax.decode.baselines import llada_transfer_counts
from d2f_jax.decode.config import DecodeSpec, Knobs, per_row
from d2f_jax.decode.result import DecodeResult, decoded_prefix, make_result
from d2f_jax.decode.sampling import choose_tokens, is_stop, rank_descending, row_keys, split_rows
from d2f_jax.models import PAD_ID, KVCache, align_logits


@flax.struct.dataclass
class BlockState:
  tokens: jax.Array  # [B, P + N + block] int32: the left-padded prompt, then the response and one block of room
  prompt_len: jax.Array  # [B] int32
  block: jax.Array  # [B] int32: the row's current block (absolute index)
  block_step: jax.Array  # [B] int32: steps taken in it (editing: steps that began with no mask in it)
  done: jax.Array  # [B] bool
  forwards: jax.Array  # [B] int32
  trace: jax.Array  # [B, N + block] int32: the row's forward that last wrote each response position (editing rewrites)
  key: jax.Array  # [B] one PRNG key per row (sampling.row_keys)
  # block_cache: K/V [L, B, W + N + block, K, D] of every block before the previous one (None: recompute all)
  cache: KVCache | None = None


def _room(spec: DecodeSpec) -> int:
  """Response columns: the last block can run up to block - 1 positions past max_new_tokens."""
  return spec.max_new_tokens + spec.block_size


def _last_block(prompt_len: jax.Array, knobs: Knobs, spec: DecodeSpec) -> jax.Array:
  """The block holding each row's last response position: by its own max_new_tokens (Knobs.block_limit
  blocks; the engine's slots ask for less than the compiled room)."""
  return (prompt_len + per_row(knobs.block_limit, 1) * spec.block_size - 1) // spec.block_size  # [B]


def fresh_state(prompt, prompt_len, key, spec: DecodeSpec) -> BlockState:
  """The state before any forward: the prompt left-padded (with block_cache, one more block of padding, so
  the previous block of the first always has columns), the response all masks, an empty cache."""
  batch, room = prompt.shape[0], _room(spec)
  prompt_len = prompt_len.astype(jnp.int32)
  if spec.block_cache:
    prompt = jnp.pad(prompt, ((0, 0), (spec.block_size, 0)), constant_values=spec.model.pad_token_id)
  response = jnp.full((batch, room), spec.model.mask_token_id, jnp.int32)
  tokens = jnp.concatenate([prompt.astype(jnp.int32), response], axis=1)  # [B, W + N + block]
  cache = KVCache.init(spec.model, batch, tokens.shape[1]) if spec.block_cache else None
  return BlockState(tokens=tokens, prompt_len=prompt_len, block=prompt_len // spec.block_size,
                    block_step=jnp.zeros((batch,), jnp.int32), done=jnp.zeros((batch,), jnp.bool_),
                    forwards=jnp.zeros((batch,), jnp.int32), trace=jnp.full((batch, room), -1, jnp.int32),
                    key=row_keys(key, batch), cache=cache)


def init(model, prompt, prompt_len, key, knobs: Knobs, spec: DecodeSpec) -> BlockState:
  del knobs
  state = fresh_state(prompt, prompt_len, key, spec)
  if not spec.block_cache:
    return state
  # Prefill: the prompt's K/V up to the previous block of the first decoded one (whole blocks: exact).
  width = state.tokens.shape[1] - _room(spec)
  positions, ids = _positions(jnp.arange(width, dtype=jnp.int32)[None, :], state, width, spec)
  _, (k, v) = model.hidden_states(state.tokens[:, :width], positions, ids)  # k, v [L, B, W, K, D]
  count = _window_start(state, width, spec)  # [B]: padding and the blocks before the previous one
  return state.replace(cache=state.cache.write(k, v, ids, count))


def _positions(cols, state: BlockState, width: int, spec: DecodeSpec):
  """(positions clamped at 0, attention ids: the block, PAD_ID on the left padding) of buffer columns cols."""
  positions = cols - (width - state.prompt_len)[:, None]  # negative on the left padding
  ids = jnp.where(positions >= 0, positions // spec.block_size, PAD_ID).astype(jnp.int32)
  return jnp.maximum(positions, 0), ids


def _window_start(state: BlockState, width: int, spec: DecodeSpec) -> jax.Array:
  """[B] the buffer column of each row's previous block: the first column a block_cache step feeds."""
  return (state.block - 1) * spec.block_size + width - state.prompt_len


def _response_logits(model, state: BlockState, spec: DecodeSpec):
  """(aligned logits [B, N + block, V] of the response columns under the block-diffusion mask, None): the
  released loop's forward over the whole sequence."""
  width = state.tokens.shape[1] - _room(spec)
  positions, ids = _positions(jnp.arange(state.tokens.shape[1], dtype=jnp.int32)[None, :], state, width, spec)
  hidden, _ = model.hidden_states(state.tokens, positions, ids)  # [B, W + N + block, E]
  raw = model.logits_from_hidden(hidden[:, width - 1:])  # [B, 1 + N + block, V]
  return align_logits(raw[:, 1:], spec.model, previous=raw[:, 0]), None


def _window_logits(model, state: BlockState, spec: DecodeSpec):
  """block_cache: (aligned logits [B, block, V] of the current block's columns, the previous block's K/V
  [L, B, block, K, D] each and ids [B, block]) from one forward over the previous and current blocks."""
  width, size = state.tokens.shape[1] - _room(spec), spec.block_size
  cols = _window_start(state, width, spec)[:, None] + jnp.arange(2 * size, dtype=jnp.int32)[None, :]  # [B, 2 bs]
  positions, ids = _positions(cols, state, width, spec)
  tokens = jnp.take_along_axis(state.tokens, cols, axis=1)
  hidden, (k, v) = model.hidden_states(tokens, positions, ids, state.cache)  # hidden [B, 2 bs, E]
  raw = model.logits_from_hidden(hidden[:, size - 1:])  # [B, 1 + bs, V]
  return align_logits(raw[:, 1:], spec.model, previous=raw[:, 0]), (k[:, :, :size], v[:, :, :size], ids[:, :size])


def _to_response(values: jax.Array, fill: jax.Array, state: BlockState, spec: DecodeSpec) -> jax.Array:
  """The current block's per-position values [B, block] laid into the response columns [B, N + block] of
  `fill` (the block's prompt part, before the response, is dropped)."""
  offset = state.block * spec.block_size - state.prompt_len  # [B] response column of the block's start
  cols = offset[:, None] + jnp.arange(spec.block_size, dtype=jnp.int32)[None, :]
  cols = jnp.where(cols >= 0, cols, fill.shape[1])  # out of range: dropped
  rows = jnp.arange(fill.shape[0])[:, None]
  return fill.at[rows, cols].set(values.astype(fill.dtype), mode="drop")


def step(model, state: BlockState, knobs: Knobs, spec: DecodeSpec) -> BlockState:
  """One forward; each live row accepts positions of its current block, and moves on or stops after it."""
  width = state.tokens.shape[1] - _room(spec)
  key, sub = split_rows(state.key, spec.sample)
  forward = _window_logits if spec.block_cache else _response_logits
  logits, written = forward(model, state, spec)  # [B, N + block or block, V]
  if spec.editing:  # never choose the mask: a chosen mask stays a mask, and this loop has no step cap
    logits = logits.at[..., spec.model.mask_token_id].set(-jnp.inf)
  choice, confidence, _ = choose_tokens(logits, sub, knobs, spec.sample)
  if spec.editing:  # a NaN confidence ranks last, so a step still accepts a mask (the loop has no step cap)
    confidence = jnp.nan_to_num(confidence, nan=-1.0)
  response = state.tokens[:, width:]  # [B, N + block]
  if spec.block_cache:  # outside the current block nothing is chosen (the masks below keep it so anyway)
    choice = _to_response(choice, response, state, spec)
    confidence = _to_response(confidence, jnp.full(response.shape, -jnp.inf, jnp.float32), state, spec)
  position = state.prompt_len[:, None] + jnp.arange(response.shape[1])[None, :]  # [B, N + block]
  in_block = position // spec.block_size == state.block[:, None]
  live = ~state.done
  masked = (response == spec.model.mask_token_id) & in_block  # [B, N + block] at the step's start
  candidate = masked & live[:, None]
  if spec.editing:  # at least one mask a step, no schedule
    need = jnp.minimum(1, candidate.sum(axis=1))  # [B]
  else:
    counts = jnp.asarray(llada_transfer_counts(spec.block_size, spec.steps))  # [steps]
    need = jnp.minimum(counts[jnp.minimum(state.block_step, spec.steps - 1)], candidate.sum(axis=1))  # [B]
  confident = candidate & (confidence > per_row(knobs.tau_conf, 2))
  most = candidate & (rank_descending(jnp.where(candidate, confidence, -jnp.inf)) < need[:, None])
  accept = jnp.where((confident.sum(axis=1) >= need)[:, None], confident, most)
  if spec.editing:  # decided response tokens of the block the model would now choose otherwise, confidently
    accept |= (in_block & ~masked & live[:, None] & (choice != response)
               & (confidence > per_row(knobs.editing_threshold, 2)))
  response = jnp.where(accept, choice, response)
  trace = jnp.where(accept, state.forwards[:, None], state.trace)
  left = ((response == spec.model.mask_token_id) & in_block).any(axis=1)
  if spec.editing:
    began_full = ~masked.any(axis=1)  # [B] a post step: it could only edit
    block_step = state.block_step + (live & began_full)
    edited = (accept & ~masked).any(axis=1)
    ended = live & ((began_full & ~edited) | (~left & (block_step >= per_row(knobs.max_post_steps, 1))))
  else:
    block_step = state.block_step + live
    ended = live & (~left | (block_step >= spec.steps))  # the block is over for these rows
  block_end = (state.block + 1) * spec.block_size  # [B]: first position after it
  seen = position < block_end[:, None]
  last = state.block >= _last_block(state.prompt_len, knobs, spec)
  stopped = (is_stop(response, knobs.stop_ids) & seen).any(axis=1) | last
  cache = state.cache
  if spec.block_cache:  # a row moving on appends its previous block, now before the previous one
    cache = cache.write(*written, jnp.where(ended & ~stopped, spec.block_size, 0))
  return state.replace(tokens=state.tokens.at[:, width:].set(response), trace=trace, key=key,
                       block=state.block + (ended & ~stopped), block_step=jnp.where(ended, 0, block_step),
                       done=state.done | (ended & stopped), forwards=state.forwards + live, cache=cache)


def running(state: BlockState, spec: DecodeSpec) -> jax.Array:
  return ~state.done.all()


def finish(state: BlockState, knobs: Knobs, spec: DecodeSpec) -> DecodeResult:
  width = state.tokens.shape[1] - _room(spec)
  n = spec.max_new_tokens
  return make_result(state.tokens[:, width:width + n], state.trace[:, :n], knobs.stop_ids, spec.model.pad_token_id,
                     state.forwards)


def final_columns(state: BlockState, spec: DecodeSpec) -> jax.Array:
  """[B] response columns no later step can change: all N, or with editing while a row decodes those of its
  finished blocks (a decided token of the current block may still be rewritten); can be negative."""
  n = jnp.full_like(state.prompt_len, spec.max_new_tokens)
  if not spec.editing:
    return n
  return jnp.where(state.done, n, state.block * spec.block_size - state.prompt_len)


def settled(state: BlockState, spec: DecodeSpec) -> list[int]:
  """Row 0's decoded response prefix (no mask before it) within its final columns, on the host."""
  width = state.tokens.shape[1] - _room(spec)
  prefix = decoded_prefix(state.tokens[0, width:width + spec.max_new_tokens], spec.model.mask_token_id)
  return prefix[:max(int(final_columns(state, spec)[0]), 0)]
