"""The engine's device programs over a fixed batch of S slots: each one jitted with static shapes, so serving
never recompiles after warm-up (one insert program per prompt bucket and admission count, one advance program).

`SlotPrograms` is their one static context (graphdef, spec, layout, steps per call): frozen and hashable, the
static first argument of each jitted program, as gemma's sampler carries its loop; its methods call them. The
device side of the slots is one pytree, `SlotBatch` (the loop state's rows and each slot's knobs):
`batch = programs.advance(params, batch)`.

The slot batch is a D2F loop state (decode/pipeline.py) whose rows start at different times. A row's
decode touches only its own row, so a request decodes exactly as it would alone:
- `insert` runs the first step of m requests of one prompt bucket (`pipeline.init`: the prefill forward
  over their bucketed prompts plus block 0) as a batch of m, then writes each row into its slot: the token
  buffer left-padded to the engine's prompt width P (positions follow the real prompt length, padding is
  invisible), the KV cache as written (slots [0, bucket) hold the prompt and later writes append at its
  length), its knobs beside.
- `advance` runs up to `steps` D2F steps over all slots inside one while_loop that exits as soon as a live
  slot finishes, so the host can refill it. A free slot is a done row: frozen, it changes nothing.
- a row stops after max_new_tokens + 2 forwards, the bound `generate`'s loop puts on a batch run alone.

An AR engine (the causal baseline model, `spec.method == 'ar'`) runs the same programs over the cached AR
loop state (decode/baselines.py) with a token counter per row: one token per row per step. A LLaDA2 engine
(`spec.method == 'llada2'`) runs them over the released block sampler's state (decode/block_sampler.py): no
cache, so `insert` only writes the rows (every step recomputes each row, as the released loop; with
block_cache it prefills the prompt's cache as d2f's does), and with editing the readout's `final` keeps a
block's tokens off the stream until no edit can change them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from d2f_jax.decode import baselines, block_sampler, pipeline
from d2f_jax.decode.config import DecodeSpec, Knobs
from d2f_jax.decode.mesh import constrain_loop_state
from d2f_jax.decode.runner.programs import ALGORITHMS
from d2f_jax.decode.sampling import row_keys
from d2f_jax.models import PAD_ID, KVCache
from d2f_jax.serve.types import STAT_KEYS
from d2f_jax.sharding import MeshLayout, mesh_layout


def _is_ar(spec: DecodeSpec) -> bool:
  return spec.method == "ar"


def _is_block(spec: DecodeSpec) -> bool:
  return spec.method == "llada2"


def _prompt_width(state, spec: DecodeSpec) -> int:
  room = 0 if _is_ar(spec) else spec.block_size if _is_block(spec) else spec.window
  return state.tokens.shape[1] - spec.max_new_tokens - room


def _fresh_ar(prompt: jax.Array, prompt_len: jax.Array, spec: DecodeSpec) -> baselines.ARState:
  slots = prompt.shape[0]
  response = jnp.full((slots, spec.max_new_tokens), spec.model.pad_token_id, jnp.int32)
  zeros = jnp.zeros((slots,), jnp.int32)
  return baselines.ARState(tokens=jnp.concatenate([prompt, response], axis=1), prompt_len=prompt_len,
                           cache=KVCache.init(spec.model, slots, prompt.shape[1] + spec.max_new_tokens),
                           done=jnp.zeros((slots,), bool), forwards=zeros,
                           trace=jnp.full((slots, spec.max_new_tokens), -1, jnp.int32),
                           key=row_keys(jax.random.key(0), slots), t=zeros)


def _put_rows(big: jax.Array, rows: jax.Array, slots: jax.Array, axis: int = 0) -> jax.Array:
  """big [..., S, ...] with rows [..., m, ...] written at slots [m] (distinct) along `axis`."""
  index = (slice(None),) * axis + (slots,)
  return big.at[index].set(rows.astype(big.dtype), unique_indices=True)


def _into_width(row, prompt_width: int, spec: DecodeSpec):
  """Rows decoded at their prompt bucket, laid out at the engine's prompt width: the token buffer
  left-padded (response block j stays at column prompt_width + j * block_size), the cache padded with
  empty slots."""
  extra = prompt_width - _prompt_width(row, spec)
  tokens = jnp.pad(row.tokens, ((0, 0), (extra, 0)), constant_values=spec.model.pad_token_id)
  if row.cache is None:  # llada2's released loop
    return row.replace(tokens=tokens)
  pad5 = ((0, 0), (0, 0), (0, extra), (0, 0), (0, 0))  # k, v [L, 1, S, K, D]
  cache = KVCache(k=jnp.pad(row.cache.k, pad5), v=jnp.pad(row.cache.v, pad5),
                  ids=jnp.pad(row.cache.ids, ((0, 0), (0, extra)), constant_values=PAD_ID), length=row.cache.length)
  return row.replace(tokens=tokens, cache=cache)


def _row_fields(state, slots: int) -> list[str]:
  """The loop state's fields with a leading slot axis, the rows' PRNG keys among them (the cache is placed
  apart; d2f's step counter is shared by all slots)."""
  return [f.name for f in dataclasses.fields(state) if f.name != "cache"
          and getattr(state, f.name).ndim and getattr(state, f.name).shape[0] == slots]


def _bounded(state, knobs: Knobs, spec: DecodeSpec):
  """Freeze rows at the bound `generate` puts on a batch run alone: max_new_tokens + 2 forwards (d2f), or
  max_new_tokens tokens (ar); llada2's loop bounds itself (steps, or max_post_steps, a block)."""
  if _is_block(spec):
    return state
  n = knobs.block_limit * spec.block_size
  over = state.t >= n if _is_ar(spec) else state.forwards >= n + 2
  return state.replace(done=state.done | over)


@flax.struct.dataclass
class SlotBatch:
  """The device side of S slots: the loop state's rows (a free slot is a done row) and each slot's knobs."""

  state: Any  # pipeline.LoopState, baselines.ARState or block_sampler.BlockState, rows [S, ...]
  knobs: Knobs  # [S] leaves, stop ids [S, K]


@flax.struct.dataclass
class Admission:
  """m requests of one prompt bucket to prefill into distinct free slots."""

  slots: jax.Array  # [m] int32
  prompt: jax.Array  # [m, bucket] int32, left-padded
  prompt_len: jax.Array  # [m] int32
  knobs: Knobs  # [m] leaves, stop ids [m, K]
  seeds: jax.Array  # [m] uint32


@dataclasses.dataclass(frozen=True)
class SlotPrograms:
  """The engine's programs and everything static about them: hashable, the static first argument of each
  jitted program below (its methods call them)."""

  graphdef: Any
  spec: DecodeSpec
  layout: MeshLayout | None = None
  steps: int = 1  # D2F steps per advance call at most

  @property
  def is_ar(self) -> bool:
    return _is_ar(self.spec)

  def empty(self, slots: int, prompt_width: int, knobs: Knobs) -> SlotBatch:
    """Every slot free (done); each slot's knobs `knobs` broadcast to [S] leaves."""
    spec = self.spec
    prompt = jnp.full((slots, prompt_width), spec.model.pad_token_id, jnp.int32)
    lengths = jnp.ones((slots,), jnp.int32)
    if self.is_ar:
      state = _fresh_ar(prompt, lengths, spec)
    elif _is_block(spec):
      state = block_sampler.fresh_state(prompt, lengths, jax.random.key(0), spec)
    else:
      state = pipeline.fresh_state(prompt, lengths, jax.random.key(0), spec)
    state = state.replace(done=jnp.ones((slots,), bool))
    rows = jax.tree.map(lambda x: jnp.broadcast_to(x, (slots,) + x.shape), knobs)
    # Own buffers per leaf (fresh_state shares one zeros array between counters): the programs donate them.
    return jax.tree.map(lambda x: jnp.array(x, copy=True), SlotBatch(state=state, knobs=rows))

  def insert(self, params, batch: SlotBatch, admission: Admission) -> SlotBatch:
    return insert_rows(self, params, batch, admission)

  def advance(self, params, batch: SlotBatch) -> SlotBatch:
    return advance_slots(self, params, batch)

  def release(self, batch: SlotBatch, slots) -> SlotBatch:
    return release_slots(self, batch, slots)

  def readout(self, batch: SlotBatch) -> dict:
    return read_slots(self, batch)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def insert_rows(programs: SlotPrograms, params, batch: SlotBatch, admission: Admission) -> SlotBatch:
  """Prefill the admitted requests into their slots in one call. Each row decodes as it would alone: the
  prefill is per row, rows never attend to each other, and a row samples from fold_in(key(seed), 0), the
  key of row 0 of `generate(..., key=jax.random.key(seed))`."""
  spec, state, a = programs.spec, batch.state, admission
  count, width = state.tokens.shape[0], _prompt_width(state, spec)
  init = ALGORITHMS[spec.method].init  # the loop `generate` runs
  with mesh_layout(programs.layout):
    keys = jax.vmap(lambda seed: row_keys(jax.random.key(seed), 1)[0])(a.seeds)  # [m]
    rows = init(nnx.merge(programs.graphdef, params), a.prompt, a.prompt_len, keys, a.knobs, spec)
  if programs.is_ar:
    rows = rows.replace(t=jnp.broadcast_to(rows.t, a.prompt_len.shape))
  rows = _into_width(rows, width, spec)
  row_leaves = {f: _put_rows(getattr(state, f), getattr(rows, f), a.slots) for f in _row_fields(state, count)}
  if state.cache is not None:  # d2f, ar, llada2 with block_cache (its released loop recomputes)
    row_leaves["cache"] = KVCache(k=_put_rows(state.cache.k, rows.cache.k, a.slots, 1),
                                  v=_put_rows(state.cache.v, rows.cache.v, a.slots, 1),
                                  ids=_put_rows(state.cache.ids, rows.cache.ids, a.slots),
                                  length=_put_rows(state.cache.length, rows.cache.length, a.slots))
  state = constrain_loop_state(state.replace(**row_leaves), programs.layout, count)
  knobs = jax.tree.map(lambda big, new: _put_rows(big, new, a.slots), batch.knobs, a.knobs)
  return SlotBatch(state=state, knobs=knobs)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def advance_slots(programs: SlotPrograms, params, batch: SlotBatch) -> SlotBatch:
  """Up to `steps` D2F steps over every slot; returns early once a slot that was live has finished."""
  spec, knobs = programs.spec, batch.knobs
  slots = batch.state.tokens.shape[0]
  was_done = batch.state.done
  step = ALGORITHMS[spec.method].step

  def running(carry):
    i, s = carry
    return (i < programs.steps) & jnp.any(~s.done) & ~jnp.any(s.done & ~was_done)

  def body(carry):
    i, s = carry
    s = _bounded(step(model, s, knobs, spec), knobs, spec)
    return i + 1, constrain_loop_state(s, programs.layout, slots)

  with mesh_layout(programs.layout):
    model = nnx.merge(programs.graphdef, params)
    _, state = jax.lax.while_loop(running, body, (jnp.int32(0), _bounded(batch.state, knobs, spec)))
  return batch.replace(state=state)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
def release_slots(programs: SlotPrograms, batch: SlotBatch, slots: jax.Array) -> SlotBatch:
  """Free slots now (cancelled requests; `slots` an index or [m] indices): their rows are frozen and their
  compute wasted until refilled."""
  return batch.replace(state=batch.state.replace(done=batch.state.done.at[slots].set(True)))


@functools.partial(jax.jit, static_argnums=0)
def read_slots(programs: SlotPrograms, batch: SlotBatch) -> dict:
  """What the host needs each round: responses [S, N], trace [S, N], done, forwards, `final` [S] (response
  columns no later step can change: N, or with llada2's editing those of the finished blocks) and the d2f
  diagnostics [S] (zero for ar and llada2; a few KB, not the cache)."""
  spec, state = programs.spec, batch.state
  width, n = _prompt_width(state, spec), spec.max_new_tokens
  zeros = jnp.zeros_like(state.forwards)
  stats = {k: getattr(state, k, zeros) for k in STAT_KEYS}
  final = block_sampler.final_columns(state, spec) if _is_block(spec) else zeros + n
  return dict(response=state.tokens[:, width:width + n], trace=state.trace[:, :n], done=state.done,
              forwards=state.forwards, final=final, **stats)
