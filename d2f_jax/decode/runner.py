"""Public entry points: `generate` (one jitted while_loop per call) and host-driven stepping / streaming.

Every method implements init / step / running / finish over its own loop state; `generate` runs them as
init + `lax.while_loop` + finish inside one jit, so a whole generation is a single device program with no
host sync per step. `generate_stepwise` and `stream` drive the very same step function from Python (one
jitted call and one host sync per step): used for streaming text and to measure what the loop saves.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any, Iterator, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from d2f_jax.decode import baselines, pipeline
from d2f_jax.decode.config import DecodeConfig, DecodeSpec, Knobs, resolve
from d2f_jax.decode.result import DecodeResult
from d2f_jax.models import ModelConfig

# method -> (init, step, running, finish)
_ALGORITHMS = {
    "d2f": (pipeline.init, pipeline.step, pipeline.running, pipeline.finish),
    "vanilla": (baselines.init_full, baselines.step_full, baselines.running_full, baselines.finish_full),
    "dream_vanilla": (baselines.init_full, baselines.step_full, baselines.running_full, baselines.finish_full),
    "ar": (baselines.init_ar, baselines.step_ar, baselines.running_ar, baselines.finish_ar),
}

_TRACES: collections.Counter = collections.Counter()


def trace_count(name: str | None = None) -> int:
  """How many times a decode program was traced (compiled): 'loop', 'init', 'step' or all together."""
  return sum(_TRACES.values()) if name is None else _TRACES[name]


@dataclasses.dataclass(frozen=True)
class DecodeModel:
  """The minimum `generate` needs: a config, the static graph and the parameter state."""

  config: ModelConfig
  graphdef: Any
  state: Any
  tokenizer: Any = None

  @classmethod
  def from_module(cls, module: nnx.Module, tokenizer=None) -> "DecodeModel":
    graphdef, state = nnx.split(module)
    return cls(config=module.config, graphdef=graphdef, state=state, tokenizer=tokenizer)


@functools.partial(jax.jit, static_argnames=("graphdef", "spec"))
def _run_loop(graphdef, params, prompt, prompt_len, key, knobs: Knobs, *, spec: DecodeSpec) -> DecodeResult:
  _TRACES["loop"] += 1
  init, step, running, finish = _ALGORITHMS[spec.method]
  model = nnx.merge(graphdef, params)
  state = init(model, prompt, prompt_len, key, knobs, spec)
  state = jax.lax.while_loop(lambda s: running(s, spec), lambda s: step(model, s, knobs, spec), state)
  return finish(state, knobs, spec)


@functools.partial(jax.jit, static_argnames=("graphdef", "spec"))
def _init(graphdef, params, prompt, prompt_len, key, knobs, *, spec):
  _TRACES["init"] += 1
  init, _, running, _ = _ALGORITHMS[spec.method]
  state = init(nnx.merge(graphdef, params), prompt, prompt_len, key, knobs, spec)
  return state, running(state, spec)


@functools.partial(jax.jit, static_argnames=("graphdef", "spec"))
def _step(graphdef, params, state, knobs, *, spec):
  _TRACES["step"] += 1
  _, step, running, _ = _ALGORITHMS[spec.method]
  state = step(nnx.merge(graphdef, params), state, knobs, spec)
  return state, running(state, spec)


@functools.partial(jax.jit, static_argnames=("spec",))
def _finish(state, knobs, *, spec):
  return _ALGORITHMS[spec.method][3](state, knobs, spec)


def pack_prompts(prompts, config: DecodeConfig, model_config: ModelConfig, mask=None):
  """Left-pad prompts into a bucketed [B, P] int32 array; returns (array, lengths [B]).

  prompts: a list of token-id lists (ragged), or a [B, T] array with an optional [B, T] mask of real
  tokens (any padding side; real tokens keep their order).
  """
  if isinstance(prompts, (list, tuple)) and (not prompts or not np.isscalar(prompts[0])) and mask is None:
    rows = [np.asarray(p, np.int64).reshape(-1) for p in prompts]
  else:
    array = np.asarray(prompts)
    if array.ndim != 2:
      raise ValueError(f"prompt_ids must be a list of id lists or a [batch, length] array, got shape {array.shape}")
    keep = np.ones(array.shape, bool) if mask is None else np.asarray(mask).astype(bool)
    if keep.shape != array.shape:
      raise ValueError(f"mask shape {keep.shape} != prompt_ids shape {array.shape}")
    rows = [array[b][keep[b]].astype(np.int64) for b in range(array.shape[0])]
  if not rows:
    raise ValueError("prompt_ids holds no prompts")
  for b, row in enumerate(rows):
    if row.size == 0:
      raise ValueError(f"prompt {b} is empty; every row needs at least one token")
    if row.min() < 0 or row.max() >= model_config.vocab_size:
      raise ValueError(f"prompt {b} has token ids outside [0, {model_config.vocab_size}): "
                       f"range [{row.min()}, {row.max()}]")
  width = config.bucket(max(r.size for r in rows))
  packed = np.full((len(rows), width), model_config.pad_token_id, np.int32)
  for b, row in enumerate(rows):
    packed[b, width - row.size:] = row
  return jnp.asarray(packed), jnp.asarray([r.size for r in rows], jnp.int32)


def _prepare(model, prompts, config: DecodeConfig, mask, key):
  if not isinstance(config, DecodeConfig):
    raise TypeError(f"config must be a DecodeConfig, got {type(config).__name__}")
  for attr in ("config", "graphdef", "state"):
    if not hasattr(model, attr):
      raise TypeError(f"model must have .config, .graphdef and .state (a LoadedModel or DecodeModel); "
                      f"{type(model).__name__} has no .{attr}")
  spec, knobs = resolve(config, model.config)
  prompt, prompt_len = pack_prompts(prompts, config, model.config, mask)
  key = jax.random.key(0) if key is None else key
  return spec, knobs, prompt, prompt_len, key


def generate(model, prompt_ids, config: DecodeConfig, *, mask=None, key=None) -> DecodeResult:
  """Decode a batch of prompts with `config.method` as one jitted `lax.while_loop`.

  model: anything with .config, .graphdef, .state. prompt_ids: list of id lists, or [B, T] + `mask`.
  key: PRNG key for sampling (temperature > 0); default key(0).
  """
  spec, knobs, prompt, prompt_len, key = _prepare(model, prompt_ids, config, mask, key)
  return _run_loop(model.graphdef, model.state, prompt, prompt_len, key, knobs, spec=spec)


def generate_stepwise(model, prompt_ids, config: DecodeConfig, *, mask=None, key=None) -> DecodeResult:
  """The same algorithm and result as `generate`, driven from Python one jitted step at a time."""
  state = None
  for state, _ in _steps(model, prompt_ids, config, mask, key):
    pass
  spec, knobs = resolve(config, model.config)
  return _finish(state, knobs, spec=spec)


def _steps(model, prompt_ids, config, mask, key) -> Iterator[tuple[Any, DecodeSpec]]:
  spec, knobs, prompt, prompt_len, key = _prepare(model, prompt_ids, config, mask, key)
  state, more = _init(model.graphdef, model.state, prompt, prompt_len, key, knobs, spec=spec)
  yield state, spec
  while bool(more):  # the host sync the jitted loop avoids
    state, more = _step(model.graphdef, model.state, state, knobs, spec=spec)
    yield state, spec


class StreamChunk(NamedTuple):
  ids: list[int]  # newly settled ids
  forwards: int  # forwards so far


def stream(model, prompt_ids: Sequence[int], config: DecodeConfig, *, key=None) -> Iterator[StreamChunk]:
  """Yield the ids of one prompt as they settle: the decoded prefix of the response, up to and including
  the first stop token. With d2f the prefix advances as blocks finish, several tokens at a time."""
  emitted = 0
  stops = None
  for state, spec in _steps(model, [list(prompt_ids)], config, None, key):
    if stops is None:
      stops = set(resolve(config, model.config)[1].stop_ids.tolist()) - {-1}
    width = state.tokens.shape[1] - spec.max_new_tokens - (spec.window if spec.method == "d2f" else 0)
    response = np.asarray(state.tokens[0, width:width + spec.max_new_tokens])
    settled = response != spec.model.mask_token_id
    end = int(np.argmin(settled)) if not settled.all() else response.size
    if spec.method == "ar":
      end = int(state.t)
    ids = response[:end].tolist()
    for i, tok in enumerate(ids):
      if tok in stops:
        ids = ids[:i + 1]
        break
    if len(ids) > emitted:
      yield StreamChunk(ids[emitted:], int(state.forwards[0]) if hasattr(state, "forwards") else int(state.t))
      emitted = len(ids)
    if ids and ids[-1] in stops:
      return
