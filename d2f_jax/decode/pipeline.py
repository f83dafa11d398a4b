"""D2F pipelined block decoding (spec section 4) as init / step / finish over a fixed-shape loop state.

Layout per row: the token buffer is [left-padded prompt (P) | response (N) | spare tail (W)], so response
block j always starts at column P + j * B and the widest window, W = min(cap + 1, N / B) * B columns
starting at the first block not yet in the cache, is a plain gather that never runs off the end.
The KV cache mirrors buffer columns slot for slot; `cache.length` = P + cached * B.

The forward itself runs on the first w * B of those columns, w the narrowest of the compiled widths
(`spec.window_widths`) that holds every row's uncached blocks: a forward costs what is in flight, not
what could be. Columns past w are blocks not yet appended, which no earlier block attends to, so the
tokens are those of the widest window. A throughput mode (query_limit / position_budget) feeds fewer
columns, gathered to the front, at compiled widths in positions instead (decode/query_window.py).

Blocks from the cache onward are, in order: `pending` finished blocks whose K/V the next forward writes
(finished-awaiting-cache), then `added - cached - pending` blocks in flight (semi- or fully activated,
possibly finished but waiting for an earlier block), then empty slots. One step is exactly one forward:
  forward the window (writing the pending blocks' K/V) -> accept tokens in the blocks in flight ->
  freeze the leading finished blocks -> append a block for the next step -> mark the row done when no
  masks remain. The append that the spec puts at the start of step t+1 runs at the end of step t, so the
  loop condition knows a row is finished before paying for another forward.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from d2f_jax.decode import query_window as qw
from d2f_jax.decode.config import DecodeSpec, Knobs, per_row
from d2f_jax.decode.result import DecodeResult, decoded_prefix, make_result
from d2f_jax.decode.sampling import argmax_first, choose_tokens, is_stop, row_keys, split_rows
from d2f_jax.decode.widths import narrowest
from d2f_jax.models import PAD_ID, KVCache, align_logits
from d2f_jax.models.attention import prompt_ids

# Window block states, as the last forward saw them (`D2FState.blocks`).
EMPTY, SEMI_ACTIVE, FULLY_ACTIVE, AWAITING_CACHE = 0, 1, 2, 3


@flax.struct.dataclass
class D2FState:
  tokens: jax.Array  # [B, P + N + W] int32
  prompt_len: jax.Array  # [B] int32 real (unpadded) prompt tokens
  cache: KVCache  # k, v [L, B, P + N, K, D]
  prev_logits: jax.Array  # [B, V] f32 raw output at the last cached position (Dream's shift)
  cached: jax.Array  # [B] int32 response blocks in the cache
  pending: jax.Array  # [B] int32 finished blocks right after them, written by the next forward
  added: jax.Array  # [B] int32 blocks appended so far
  eos: jax.Array  # [B] bool a stop token was accepted: no more blocks
  done: jax.Array  # [B] bool no masks left: the row is frozen
  forwards: jax.Array  # [B] int32 forwards (= steps) the row took
  trace: jax.Array  # [B, N + W] int32 step at which each response position was accepted, -1
  blocks: jax.Array  # [B, window_blocks] int32 state of each slot of the widest window (EMPTY ...)
  key: jax.Array  # [B] PRNG keys, one per row (sampling.row_keys), each split once per step
  t: jax.Array  # () int32 loop iterations (safety bound)
  max_in_flight: jax.Array  # [B] int32
  semi_steps: jax.Array  # [B] int32
  max_accepted: jax.Array  # [B] int32
  in_flight_sum: jax.Array  # [B] int32 blocks in flight summed over the row's forwards
  window_sum: jax.Array  # [B] int32 window width (blocks) summed over the row's forwards
  position_sum: jax.Array  # [B] int32 positions its forwards computed (the compiled width), summed


def _prompt_width(state: D2FState, spec: DecodeSpec) -> int:
  return state.tokens.shape[1] - spec.max_new_tokens - spec.window


def _window_columns(start_block: jax.Array, prompt_width: int, spec: DecodeSpec) -> jax.Array:
  """Buffer columns [B, W] of the widest window, starting at response block `start_block` [B]."""
  start = prompt_width + start_block * spec.block_size  # [B]
  return start[:, None] + jnp.arange(spec.window, dtype=jnp.int32)[None, :]


def _window_inputs(state: D2FState, spec: DecodeSpec):
  """Tokens, positions and attention ids [B, W] of the widest window, plus its columns; a narrower
  window is their first columns."""
  width = _prompt_width(state, spec)
  cols = _window_columns(state.cached, width, spec)
  tokens = jnp.take_along_axis(state.tokens, cols, axis=1)
  block = (cols - width) // spec.block_size  # [B, W] response block of each column
  ids = jnp.where(block < state.added[:, None], block, PAD_ID)  # blocks not appended are invisible
  positions = cols - (width - state.prompt_len)[:, None]  # cumsum(mask) - 1 under left padding
  return tokens, positions, ids.astype(jnp.int32), cols


def _pad_columns(x: jax.Array, width: int, value) -> jax.Array:
  """x [B, w, ...] -> [B, width, ...], filled with `value` (columns of blocks not in this window)."""
  pad = [(0, 0)] * x.ndim
  pad[1] = (0, width - x.shape[1])
  return jnp.pad(x, pad, constant_values=value)


def _choose(logits, key, knobs: Knobs, spec: DecodeSpec):
  """Chosen ids and confidences [B, W] for aligned logits [B, w, V], padded to the widest window."""
  choice, confidence, _ = choose_tokens(logits, key, knobs, spec.sample)
  return (_pad_columns(choice, spec.window, spec.model.mask_token_id),
          _pad_columns(confidence, spec.window, -jnp.inf))


def fresh_state(prompt: jax.Array, prompt_len: jax.Array, key: jax.Array, spec: DecodeSpec) -> D2FState:
  """The loop state before the first forward: block 0 appended, an empty cache, every counter zero."""
  config = spec.model
  batch, width = prompt.shape
  tail = jnp.full((batch, spec.max_new_tokens + spec.window), config.mask_token_id, jnp.int32)
  zeros = jnp.zeros((batch,), jnp.int32)
  return D2FState(
      tokens=jnp.concatenate([prompt.astype(jnp.int32), tail], axis=1), prompt_len=prompt_len.astype(jnp.int32),
      cache=KVCache.init(config, batch, width + spec.max_new_tokens),
      prev_logits=jnp.zeros((batch, config.vocab_size), jnp.float32), cached=zeros, pending=zeros,
      added=jnp.ones((batch,), jnp.int32), eos=jnp.zeros((batch,), bool), done=jnp.zeros((batch,), bool),
      forwards=zeros, trace=jnp.full((batch, spec.max_new_tokens + spec.window), -1, jnp.int32),
      key=row_keys(key, batch),
      blocks=jnp.zeros((batch, spec.window_blocks), jnp.int32), t=jnp.int32(0), max_in_flight=zeros,
      semi_steps=zeros, max_accepted=zeros, in_flight_sum=zeros, window_sum=zeros, position_sum=zeros)


def init(model, prompt: jax.Array, prompt_len: jax.Array, key: jax.Array, knobs: Knobs,
         spec: DecodeSpec) -> D2FState:
  """Append block 0 and run the first step: one forward over prompt + window that also prefills the cache.
  Only block 0 exists, so the window is the narrowest compiled one.

  prompt: [B, P] left-padded ids; prompt_len: [B] real lengths (>= 1); key: one key (row i samples from
  fold_in(key, i)) or the rows' own keys [B].
  """
  config = spec.model
  batch, width = prompt.shape
  state = fresh_state(prompt, prompt_len, key, spec)
  win_tokens, win_positions, win_ids, win_cols = _window_inputs(state, spec)
  w = spec.window_widths[0] * spec.block_size
  cols = jnp.arange(width, dtype=jnp.int32)[None, :]  # [1, P]
  is_prompt = cols >= (width - state.prompt_len)[:, None]  # [B, P] False on left padding
  tokens = jnp.concatenate([state.tokens[:, :width], win_tokens[:, :w]], axis=1)  # [B, P + w]
  positions = jnp.concatenate([jnp.maximum(cols - (width - state.prompt_len)[:, None], 0), win_positions[:, :w]],
                              axis=1)
  win_ids = win_ids[:, :w]
  if spec.query_mode:  # only block 0's first q positions are fed: the later ones are invisible padding
    win_ids = jnp.where(jnp.arange(w)[None, :] < per_row(knobs.query_limit, 2), win_ids, PAD_ID)
  block_ids = prompt_ids(positions[:, :width], state.prompt_len[:, None], spec.block_size, config.prompt_blocks)
  ids = jnp.concatenate([jnp.where(is_prompt, block_ids, PAD_ID), win_ids], axis=1).astype(jnp.int32)
  hidden, (k, v) = model.hidden_states(tokens, positions, ids, state.cache)  # hidden [B, P + w, E]
  cache = state.cache.write(k, v, ids, jnp.full((batch,), width, jnp.int32))  # the prompt only
  # The head runs on the window and the last prompt row only (Dream's shift takes its output).
  raw = model.logits_from_hidden(hidden[:, width - 1:])  # [B, 1 + w, V]
  logits = align_logits(raw[:, 1:], config, previous=raw[:, 0])  # [B, w, V]
  key, sub = split_rows(state.key, spec.sample)
  choice, confidence = _choose(logits, sub, knobs, spec)
  if spec.query_mode:  # block 0 is all masks: its first q (the rest, fed as padding here, are not candidates)
    confidence = jnp.where(jnp.arange(spec.window)[None, :] < per_row(knobs.query_limit, 2), confidence, -jnp.inf)
  state = state.replace(cache=cache, prev_logits=raw[:, 0], key=key)
  return _advance(state, win_tokens, win_cols, choice, confidence, spec.window_widths[0], w, knobs, spec)


def width_index(state: D2FState, spec: DecodeSpec) -> jax.Array:
  """() int32: the narrowest compiled window that holds every live row's uncached blocks."""
  needed = jnp.max(jnp.where(state.done, 1, state.added - state.cached))  # blocks from the first uncached
  return narrowest(spec.window_widths, needed)


def step(model, state: D2FState, knobs: Knobs, spec: DecodeSpec) -> D2FState:
  """One forward over the window against the cache, writing the pending blocks' K/V, then accept.

  The forward runs at the narrowest compiled width that holds the blocks in flight (`lax.switch` over
  `spec.window_widths`); every branch returns widest-window shapes, so the bookkeeping is width-free."""
  tokens, positions, ids, cols = _window_inputs(state, spec)
  written = jnp.where(state.done, 0, state.pending * spec.block_size)  # [B]
  key, sub = split_rows(state.key, spec.sample)

  def forward(blocks: int):
    def run(_):
      w = blocks * spec.block_size
      raw, (k, v) = model(tokens[:, :w], positions[:, :w], ids[:, :w], state.cache)  # raw [B, w, V]
      logits = align_logits(raw, spec.model, previous=state.prev_logits)  # [B, w, V]
      last = jnp.maximum(written - 1, 0)  # window row of the last token now cached
      last_row = jnp.take_along_axis(raw, last[:, None, None], axis=1)[:, 0]  # [B, V]
      choice, confidence = _choose(logits, sub, knobs, spec)
      pad = ((0, 0), (0, 0), (0, spec.window - w), (0, 0), (0, 0))  # k, v [L, B, w, K, D] -> [L, B, W, K, D]
      return jnp.pad(k, pad), jnp.pad(v, pad), last_row, choice, confidence
    return run

  if not spec.query_mode:
    index = width_index(state, spec)
    used = jnp.asarray(spec.window_widths, jnp.int32)[index]
    positions_used = used * spec.block_size
    branches = [forward(b) for b in spec.window_widths]
    k, v, last_row, choice, confidence = (branches[0](None) if len(branches) == 1
                                          else jax.lax.switch(index, branches, None))
    cache = state.cache.write(k, v, ids, written)
  else:  # a throughput mode: only the fed columns, gathered to the front (query_window.py)
    last_row, choice, confidence, cache, positions_used = qw.step_forward(model, state, tokens, positions, ids,
                                                                          written, sub, knobs, spec)
    used = -(-positions_used // spec.block_size)
  prev = jnp.where((written > 0)[:, None], last_row, state.prev_logits)
  return _advance(state.replace(cache=cache, prev_logits=prev, key=key), tokens, cols, choice, confidence, used,
                  positions_used, knobs, spec)


def _advance(state: D2FState, window: jax.Array, cols: jax.Array, choice: jax.Array, confidence: jax.Array,
             used_blocks, used_positions, knobs: Knobs, spec: DecodeSpec) -> D2FState:
  """Acceptance and block bookkeeping after a forward.

  window: [B, W] the widest window's tokens, at buffer columns `cols` [B, W]; choice / confidence: [B, W]
  the chosen ids and their confidences (columns past the forward's width: blocks not yet appended);
  used_blocks / used_positions: the forward's width in blocks (rounded up) and positions (diagnostics).
  """
  bs, nk = spec.block_size, spec.window_blocks
  batch = window.shape[0]
  width = _prompt_width(state, spec)
  live = ~state.done  # [B]

  slot = jnp.arange(nk, dtype=jnp.int32)[None, :]  # [1, nk] window block slots
  exists = state.cached[:, None] + slot < state.added[:, None]  # [B, nk]
  waiting = slot < state.pending[:, None]  # finished, K/V written by this forward
  in_flight = exists & ~waiting
  masked = (window == spec.model.mask_token_id).reshape(batch, nk, bs) & exists[..., None]  # [B, nk, bs]
  masks = masked.sum(-1)  # [B, nk]
  decoded = bs - masks
  # Block i is fully activated once block i-1 is decoded past tau_act; the first block's predecessor
  # is the prompt or a cached block (complete). Decoded counts only grow, so activation is sticky.
  before = jnp.concatenate([jnp.full((batch, 1), bs, jnp.int32), decoded[:, :-1]], axis=1)
  fully = before >= per_row(knobs.act_count, 2)  # [B, nk]

  choice = choice.reshape(batch, nk, bs)
  confidence = confidence.reshape(batch, nk, bs)
  candidate = masked & in_flight[..., None]  # [B, nk, bs]
  over = candidate & (confidence > per_row(knobs.tau_conf, 3))
  # A fully activated block that clears no position takes its single most confident one.
  best = argmax_first(jnp.where(candidate, confidence, -jnp.inf))  # [B, nk]
  forced = in_flight & fully & (masks > 0) & ~over.any(-1)
  accept = over | (jax.nn.one_hot(best, bs, dtype=bool) & forced[..., None])
  accept = accept & live[:, None, None]  # [B, nk, bs]

  flat = accept.reshape(batch, -1)  # [B, W]
  rows = jnp.arange(batch)[:, None]
  tokens = state.tokens.at[rows, cols].set(jnp.where(flat, choice.reshape(batch, -1), window))
  trace_cols = cols - width
  old_trace = jnp.take_along_axis(state.trace, trace_cols, axis=1)
  trace = state.trace.at[rows, trace_cols].set(jnp.where(flat, state.forwards[:, None], old_trace))
  eos = state.eos | jnp.any(accept & is_stop(choice, knobs.stop_ids), axis=(1, 2))

  # Freeze: the leading run of finished blocks (after those written now) awaits its cache write.
  # Counted from the tokens, as every step counts them: an accepted choice equal to the mask id (a model
  # may prefer it) leaves its position masked, as in the authors' loop.
  after = jnp.where(accept, choice, window.reshape(batch, nk, bs))  # [B, nk, bs]
  masks_after = ((after == spec.model.mask_token_id) & exists[..., None]).sum(-1)  # [B, nk]
  finished = exists & (masks_after == 0)  # [B, nk] (the blocks written now are finished too)
  run = jnp.cumprod(finished.astype(jnp.int32), axis=1).sum(axis=1)  # [B] leading finished slots
  cached = state.cached + state.pending
  pending = run - state.pending

  # Append for the next step: room in flight, no stop token yet, last block decoded past tau_add.
  last_slot = state.added - 1 - state.cached  # [B] in [0, nk)
  last_decoded = jnp.take_along_axis(bs - masks_after, jnp.clip(last_slot, 0, nk - 1)[:, None], axis=1)[:, 0]
  flying = state.added - cached - pending
  room = flying < jnp.minimum(spec.max_blocks_in_flight, knobs.in_flight_cap)
  grow = (live & (state.added < jnp.minimum(spec.num_blocks, knobs.block_limit)) & ~eos
          & (last_decoded >= knobs.add_count) & room)
  remaining = masks_after.sum(axis=1) + grow * bs

  def keep(new, old):
    return jnp.where(live, new, old)

  blocks = jnp.where(waiting, AWAITING_CACHE, jnp.where(fully, FULLY_ACTIVE, SEMI_ACTIVE))
  blocks = jnp.where(exists, blocks, EMPTY)  # [B, nk]
  semi = jnp.any((blocks == SEMI_ACTIVE) & (masks > 0), axis=1)
  return state.replace(
      tokens=tokens, trace=trace, t=state.t + 1, eos=keep(eos, state.eos),
      blocks=jnp.where(live[:, None], blocks, state.blocks),
      cached=keep(cached, state.cached), pending=keep(pending, state.pending),
      added=state.added + grow, done=state.done | (remaining == 0), forwards=state.forwards + live,
      max_in_flight=keep(jnp.maximum(state.max_in_flight, in_flight.sum(1)), state.max_in_flight),
      semi_steps=state.semi_steps + (live & semi),
      max_accepted=keep(jnp.maximum(state.max_accepted, flat.sum(1)), state.max_accepted),
      in_flight_sum=state.in_flight_sum + live * in_flight.sum(1).astype(jnp.int32),
      window_sum=state.window_sum + live * used_blocks, position_sum=state.position_sum + live * used_positions)


def running(state: D2FState, spec: DecodeSpec) -> jax.Array:
  """Loop condition: some row still has masks (each step accepts >= 1 token, so N + 1 steps suffice)."""
  return jnp.any(~state.done) & (state.t <= spec.max_new_tokens + 1)


def finish(state: D2FState, knobs: Knobs, spec: DecodeSpec) -> DecodeResult:
  width = _prompt_width(state, spec)
  response = state.tokens[:, width:width + spec.max_new_tokens]
  return make_result(response, state.trace[:, :spec.max_new_tokens], knobs.stop_ids, spec.model.pad_token_id,
                     state.forwards, max_in_flight=state.max_in_flight, semi_steps=state.semi_steps,
                     max_accepted=state.max_accepted, in_flight_sum=state.in_flight_sum,
                     window_sum=state.window_sum, position_sum=state.position_sum)


def settled(state: D2FState, spec: DecodeSpec) -> list[int]:
  """Row 0's response prefix that is decoded (no mask before it), read on the host: what `stream` shows."""
  width = _prompt_width(state, spec)
  return decoded_prefix(state.tokens[0, width:width + spec.max_new_tokens], spec.model.mask_token_id)
