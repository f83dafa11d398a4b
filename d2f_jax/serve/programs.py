"""The engine's device programs over a fixed batch of S slots: each one jitted with static shapes, so serving
never recompiles after warm-up (one insert program per prompt bucket and admission count, one advance program).

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
loop state (decode/baselines.py) with a token counter per row: one token per row per step.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from d2f_jax.decode import baselines, pipeline
from d2f_jax.decode.config import DecodeSpec, Knobs
from d2f_jax.decode.mesh import constrain_loop_state
from d2f_jax.decode.sampling import row_keys
from d2f_jax.models import PAD_ID, KVCache
from d2f_jax.serve.types import STAT_KEYS
from d2f_jax.sharding import MeshLayout, mesh_layout


def _is_ar(spec: DecodeSpec) -> bool:
  return spec.method == "ar"


def _prompt_width(state, spec: DecodeSpec) -> int:
  return state.tokens.shape[1] - spec.max_new_tokens - (0 if _is_ar(spec) else spec.window)


def _fresh_ar(prompt: jax.Array, prompt_len: jax.Array, spec: DecodeSpec) -> baselines.ARState:
  slots = prompt.shape[0]
  response = jnp.full((slots, spec.max_new_tokens), spec.model.pad_token_id, jnp.int32)
  zeros = jnp.zeros((slots,), jnp.int32)
  return baselines.ARState(tokens=jnp.concatenate([prompt, response], axis=1), prompt_len=prompt_len,
                           cache=KVCache.init(spec.model, slots, prompt.shape[1] + spec.max_new_tokens),
                           done=jnp.zeros((slots,), bool), forwards=zeros,
                           trace=jnp.full((slots, spec.max_new_tokens), -1, jnp.int32),
                           key=row_keys(jax.random.key(0), slots), t=zeros)


def empty_slots(spec: DecodeSpec, slots: int, prompt_width: int, knobs: Knobs):
  """A slot batch with every slot free (done), and per-slot knobs ([S] leaves, stop ids [S, K])."""
  prompt = jnp.full((slots, prompt_width), spec.model.pad_token_id, jnp.int32)
  lengths = jnp.ones((slots,), jnp.int32)
  state = (_fresh_ar(prompt, lengths, spec) if _is_ar(spec)
           else pipeline.fresh_state(prompt, lengths, jax.random.key(0), spec))
  state = state.replace(done=jnp.ones((slots,), bool))
  rows = jax.tree.map(lambda x: jnp.broadcast_to(x, (slots,) + x.shape), knobs)
  # Own buffers per leaf (fresh_state shares one zeros array between counters): the programs donate them.
  return jax.tree.map(lambda x: jnp.array(x, copy=True), (state, rows))


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
  pad5 = ((0, 0), (0, 0), (0, extra), (0, 0), (0, 0))  # k, v [L, 1, S, K, D]
  cache = KVCache(k=jnp.pad(row.cache.k, pad5), v=jnp.pad(row.cache.v, pad5),
                  ids=jnp.pad(row.cache.ids, ((0, 0), (0, extra)), constant_values=PAD_ID), length=row.cache.length)
  return row.replace(tokens=tokens, cache=cache)


@functools.partial(jax.jit, static_argnames=("graphdef", "spec", "layout"), donate_argnums=(2, 3))
def insert(graphdef, params, state, knobs: Knobs, slots: jax.Array, prompt: jax.Array,
           prompt_len: jax.Array, row_knobs: Knobs, seeds: jax.Array, *, spec: DecodeSpec,
           layout: MeshLayout | None = None):
  """Prefill m requests into distinct free `slots` [m] in one call: prompt [m, bucket] left-padded,
  prompt_len [m], row_knobs leaves [m, ...], seeds [m] uint32. Each row decodes as it would alone: the
  prefill is per row, rows never attend to each other, and a row samples from fold_in(key(seed), 0), the key
  of row 0 of `generate(..., key=jax.random.key(seed))`."""
  count, width = state.tokens.shape[0], _prompt_width(state, spec)
  init = baselines.init_ar if _is_ar(spec) else pipeline.init
  with mesh_layout(layout):
    keys = jax.vmap(lambda seed: row_keys(jax.random.key(seed), 1)[0])(seeds)  # [m]
    rows = init(nnx.merge(graphdef, params), prompt, prompt_len, keys, row_knobs, spec)
  if _is_ar(spec):
    rows = rows.replace(t=jnp.broadcast_to(rows.t, prompt_len.shape))
  rows = _into_width(rows, width, spec)
  cache = KVCache(k=_put_rows(state.cache.k, rows.cache.k, slots, 1),
                  v=_put_rows(state.cache.v, rows.cache.v, slots, 1),
                  ids=_put_rows(state.cache.ids, rows.cache.ids, slots),
                  length=_put_rows(state.cache.length, rows.cache.length, slots))
  batch_leaves = {f: _put_rows(getattr(state, f), getattr(rows, f), slots) for f in _row_fields(state, count)}
  state = state.replace(cache=cache, **batch_leaves)
  knobs = jax.tree.map(lambda big, new: _put_rows(big, new, slots), knobs, row_knobs)
  return constrain_loop_state(state, layout, count), knobs


def _row_fields(state, slots: int) -> list[str]:
  """The loop state's fields with a leading slot axis, the rows' PRNG keys among them (the cache is placed
  apart; d2f's step counter is shared by all slots)."""
  return [f.name for f in dataclasses.fields(state) if f.name != "cache"
          and getattr(state, f.name).ndim and getattr(state, f.name).shape[0] == slots]


def _bounded(state, knobs: Knobs, spec: DecodeSpec):
  """Freeze rows at the bound `generate` puts on a batch run alone: max_new_tokens + 2 forwards (d2f), or
  max_new_tokens tokens (ar)."""
  n = knobs.block_limit * spec.block_size
  over = state.t >= n if _is_ar(spec) else state.forwards >= n + 2
  return state.replace(done=state.done | over)


@functools.partial(jax.jit, static_argnames=("graphdef", "spec", "layout", "steps"), donate_argnums=(2,))
def advance(graphdef, params, state, knobs: Knobs, *, spec: DecodeSpec, steps: int,
            layout: MeshLayout | None = None):
  """Up to `steps` D2F steps over every slot; returns early once a slot that was live has finished."""
  slots = state.tokens.shape[0]
  was_done = state.done
  step = baselines.step_ar if _is_ar(spec) else pipeline.step

  def running(carry):
    i, s = carry
    return (i < steps) & jnp.any(~s.done) & ~jnp.any(s.done & ~was_done)

  def body(carry):
    i, s = carry
    s = _bounded(step(model, s, knobs, spec), knobs, spec)
    return i + 1, constrain_loop_state(s, layout, slots)

  with mesh_layout(layout):
    model = nnx.merge(graphdef, params)
    _, state = jax.lax.while_loop(running, body, (jnp.int32(0), _bounded(state, knobs, spec)))
  return state


@functools.partial(jax.jit, donate_argnums=(0,))
def release(state, slots: jax.Array):
  """Free slots now (cancelled requests; `slots` an index or [m] indices): their rows are frozen and their
  compute wasted until refilled."""
  return state.replace(done=state.done.at[slots].set(True))


@functools.partial(jax.jit, static_argnames=("spec",))
def readout(state, *, spec: DecodeSpec):
  """What the host needs each round: responses [S, N], trace [S, N], done, forwards and the d2f
  diagnostics [S] (zero for ar; a few KB, not the cache)."""
  width, n = _prompt_width(state, spec), spec.max_new_tokens
  zeros = jnp.zeros_like(state.forwards)
  stats = {k: getattr(state, k, zeros) for k in STAT_KEYS}
  return dict(response=state.tokens[:, width:width + n], trace=state.trace[:, :n], done=state.done,
              forwards=state.forwards, **stats)
