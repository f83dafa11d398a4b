"""The jitted decode programs: each method's init / step / running / finish, and the jit-cached loop over them.

`run_loop` is init + `lax.while_loop` + finish in one jit (what `generate` runs); `init_program`, `step_program` and
`finish_program` are the same pieces jitted apart, for host-driven stepping. Each is traced in the mesh layout
with the loop state pinned to it every step; `trace_count` counts their traces (compiles).
"""

from __future__ import annotations

import collections
import functools
from typing import Callable, NamedTuple

import jax
from flax import nnx

from d2f_jax.decode import baselines, block_sampler, pipeline
from d2f_jax.decode.config import DecodeSpec, Knobs
from d2f_jax.decode.mesh import constrain_loop_state, replicate
from d2f_jax.decode.result import DecodeResult
from d2f_jax.sharding.layout import MeshLayout, mesh_layout


class Algorithm(NamedTuple):
  """A decoder as the runner drives it: traced init / step / running / finish, and `settled` (host side:
  row 0's response ids decoded so far, for streaming)."""
  init: Callable
  step: Callable
  running: Callable
  finish: Callable
  settled: Callable


_FULL = Algorithm(baselines.init_full, baselines.step_full, baselines.running_full, baselines.finish_full,
                  baselines.settled_full)
ALGORITHMS = {  # by DecodeSpec.method ('threshold' resolves to d2f)
    "d2f": Algorithm(pipeline.init, pipeline.step, pipeline.running, pipeline.finish, pipeline.settled),
    "vanilla": _FULL,
    "dream_vanilla": _FULL,
    "llada2": Algorithm(block_sampler.init, block_sampler.step, block_sampler.running, block_sampler.finish,
                        block_sampler.settled),
    "ar": Algorithm(baselines.init_ar, baselines.step_ar, baselines.running_ar, baselines.finish_ar,
                    baselines.settled_ar),
}

_TRACES: collections.Counter = collections.Counter()


def trace_count(name: str | None = None) -> int:
  """How many times a decode program was traced (compiled): 'loop', 'init', 'step' or all together."""
  return sum(_TRACES.values()) if name is None else _TRACES[name]


def decode_loop(graphdef, params, prompt, prompt_len, key, knobs: Knobs, spec: DecodeSpec,
            layout: MeshLayout | None) -> DecodeResult:
  """init + while_loop + finish, traced in `layout` with the loop state pinned to it every step."""
  init, step, running, finish, _ = ALGORITHMS[spec.method]
  pin = functools.partial(constrain_loop_state, layout=layout, batch=prompt.shape[0])
  with mesh_layout(layout):
    model = nnx.merge(graphdef, params)
    state = pin(init(model, prompt, prompt_len, key, knobs, spec))
    state = jax.lax.while_loop(lambda s: running(s, spec), lambda s: pin(step(model, s, knobs, spec)), state)
    return replicate(finish(state, knobs, spec), layout)


@functools.partial(jax.jit, static_argnames=("graphdef", "spec", "layout"))
def run_loop(graphdef, params, prompt, prompt_len, key, knobs: Knobs, *, spec: DecodeSpec,
              layout: MeshLayout | None = None) -> DecodeResult:
  _TRACES["loop"] += 1
  return decode_loop(graphdef, params, prompt, prompt_len, key, knobs, spec, layout)


@functools.partial(jax.jit, static_argnames=("graphdef", "spec", "layout"))
def init_program(graphdef, params, prompt, prompt_len, key, knobs, *, spec, layout=None):
  _TRACES["init"] += 1
  init, running = ALGORITHMS[spec.method].init, ALGORITHMS[spec.method].running
  with mesh_layout(layout):
    state = init(nnx.merge(graphdef, params), prompt, prompt_len, key, knobs, spec)
    state = constrain_loop_state(state, layout, prompt.shape[0])
    return state, running(state, spec)


@functools.partial(jax.jit, static_argnames=("graphdef", "spec", "layout"))
def step_program(graphdef, params, state, knobs, *, spec, layout=None):
  _TRACES["step"] += 1
  step, running = ALGORITHMS[spec.method].step, ALGORITHMS[spec.method].running
  with mesh_layout(layout):
    state = step(nnx.merge(graphdef, params), state, knobs, spec)
    state = constrain_loop_state(state, layout, state.prompt_len.shape[0])
    return state, running(state, spec)


@functools.partial(jax.jit, static_argnames=("spec", "layout"))
def finish_program(state, knobs, *, spec, layout=None):
  return replicate(ALGORITHMS[spec.method].finish(state, knobs, spec), layout)
