"""Public entry points: `generate` (one jitted while_loop per call) and host-driven stepping / streaming.

Every method implements init / step / running / finish over its own loop state; `generate` runs them as
init + `lax.while_loop` + finish inside one jit, so a whole generation is a single device program with no
host sync per step. `generate_stepwise` and `stream` drive the very same step function from Python (one
jitted call and one host sync per step): used for streaming text and to measure what the loop saves.

On a mesh (`model.shard(mesh)` or `mesh=`), weights sit in training's shardings, rows are padded to the row
shards and split over them, and the whole loop is traced inside `mesh_layout` (decode/mesh.py), so attention
kernels run in shard_map. `decode_program` builds the same jitted loop over abstract inputs for
ahead-of-time compilation.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from d2f_jax.decode import baselines, limits, pipeline
from d2f_jax.decode.config import DecodeConfig, DecodeSpec, Knobs, resolve
from d2f_jax.decode.mesh import (DecodeMesh, as_decode_mesh, constrain_loop_state, place_inputs, place_state,
                                 replicate)
from d2f_jax.decode.result import DecodeResult
from d2f_jax.models import ModelConfig, Transformer
from d2f_jax.models.sharding_hints import MeshLayout, mesh_layout

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
_ALGORITHMS = {  # by DecodeSpec.method ('threshold' resolves to d2f)
    "d2f": Algorithm(pipeline.init, pipeline.step, pipeline.running, pipeline.finish, pipeline.settled),
    "vanilla": _FULL,
    "dream_vanilla": _FULL,
    "ar": Algorithm(baselines.init_ar, baselines.step_ar, baselines.running_ar, baselines.finish_ar,
                    baselines.settled_ar),
}

_TRACES: collections.Counter = collections.Counter()


def trace_count(name: str | None = None) -> int:
  """How many times a decode program was traced (compiled): 'loop', 'init', 'step' or all together."""
  return sum(_TRACES.values()) if name is None else _TRACES[name]


@dataclasses.dataclass(frozen=True)
class DecodeModel:
  """The model handle every decoder takes: a config, the static graph and the parameter state, with the
  tokenizer, the separate LoRA config, the directory it came from and (once `shard`ed) the mesh the state
  lives on. `d2f_jax.load_model` returns its subclass LoadedModel (adds logits / encode / decode)."""

  config: ModelConfig
  graphdef: Any  # nnx.GraphDef: static, hashable
  state: Any  # nnx.State: parameters (and LoRA parameters, when kept separate)
  tokenizer: Any = None
  placement: DecodeMesh | None = None
  lora: Any = None  # LoraConfig when the LoRA parameters are kept separate
  source: str = ""  # the directory it was loaded from ("" when built in memory)

  @classmethod
  def from_module(cls, module: nnx.Module, tokenizer=None) -> "DecodeModel":
    graphdef, state = nnx.split(module)
    return cls(config=module.config, graphdef=graphdef, state=state, tokenizer=tokenizer,
               lora=getattr(module, "lora", None))

  @property
  def mesh(self):
    return None if self.placement is None else self.placement.mesh

  def shard(self, mesh, rules=None) -> "DecodeModel":
    """A copy with its weights in the logical `rules`' shardings on `mesh` (default rules: training's)."""
    return shard_model(self, mesh, rules)

  def with_attention(self, impl: str) -> "DecodeModel":
    """A copy whose attention runs as `impl` ('auto', 'xla', 'pallas', 'interpret_gpu', 'interpret_tpu')."""
    return with_attention(self, impl)


def shard_model(model, mesh, rules=None):
  """A copy of `model` (a DecodeModel or LoadedModel) placed on `mesh`."""
  placement = as_decode_mesh(mesh, rules)
  state = model.state if placement is None else place_state(model.state, placement)
  return dataclasses.replace(model, state=state, placement=placement)


def with_attention(model, impl: str):
  """A copy of `model` whose attention runs as `impl` ('auto', 'xla', 'pallas', 'interpret_*'): a new
  static graph over the same parameter state (no copy of the weights)."""
  if impl == model.config.attention_impl:
    return model
  config = model.config.replace(attention_impl=impl)  # validates impl
  lora = getattr(nnx.merge(model.graphdef, model.state), "lora", None)
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: Transformer(config, lora, rngs=nnx.Rngs(0))))
  return dataclasses.replace(model, config=config, graphdef=graphdef)


def _decode(graphdef, params, prompt, prompt_len, key, knobs: Knobs, spec: DecodeSpec,
            layout: MeshLayout | None) -> DecodeResult:
  """init + while_loop + finish, traced in `layout` with the loop state pinned to it every step."""
  init, step, running, finish, _ = _ALGORITHMS[spec.method]
  pin = functools.partial(constrain_loop_state, layout=layout, batch=prompt.shape[0])
  with mesh_layout(layout):
    model = nnx.merge(graphdef, params)
    state = pin(init(model, prompt, prompt_len, key, knobs, spec))
    state = jax.lax.while_loop(lambda s: running(s, spec), lambda s: pin(step(model, s, knobs, spec)), state)
    return replicate(finish(state, knobs, spec), layout)


@functools.partial(jax.jit, static_argnames=("graphdef", "spec", "layout"))
def _run_loop(graphdef, params, prompt, prompt_len, key, knobs: Knobs, *, spec: DecodeSpec,
              layout: MeshLayout | None = None) -> DecodeResult:
  _TRACES["loop"] += 1
  return _decode(graphdef, params, prompt, prompt_len, key, knobs, spec, layout)


@functools.partial(jax.jit, static_argnames=("graphdef", "spec", "layout"))
def _init(graphdef, params, prompt, prompt_len, key, knobs, *, spec, layout=None):
  _TRACES["init"] += 1
  init, running = _ALGORITHMS[spec.method].init, _ALGORITHMS[spec.method].running
  with mesh_layout(layout):
    state = init(nnx.merge(graphdef, params), prompt, prompt_len, key, knobs, spec)
    state = constrain_loop_state(state, layout, prompt.shape[0])
    return state, running(state, spec)


@functools.partial(jax.jit, static_argnames=("graphdef", "spec", "layout"))
def _step(graphdef, params, state, knobs, *, spec, layout=None):
  _TRACES["step"] += 1
  step, running = _ALGORITHMS[spec.method].step, _ALGORITHMS[spec.method].running
  with mesh_layout(layout):
    state = step(nnx.merge(graphdef, params), state, knobs, spec)
    state = constrain_loop_state(state, layout, state.prompt_len.shape[0])
    return state, running(state, spec)


@functools.partial(jax.jit, static_argnames=("spec", "layout"))
def _finish(state, knobs, *, spec, layout=None):
  return replicate(_ALGORITHMS[spec.method].finish(state, knobs, spec), layout)


def pack_prompts(prompts, config: DecodeConfig, model_config: ModelConfig, mask=None):
  """Left-pad prompts into a bucketed [B, P] int32 array; returns (array, lengths [B]).

  prompts: a list of token-id lists (ragged), or a [B, T] array with an optional [B, T] mask of real
  tokens (any padding side; real tokens keep their order).
  """
  rows = limits.prompt_rows(prompts, mask)
  limits.check_vocabulary(rows, model_config)
  width = config.bucket(max(r.size for r in rows))
  packed = np.full((len(rows), width), model_config.pad_token_id, np.int32)
  for b, row in enumerate(rows):
    packed[b, width - row.size:] = row
  return jnp.asarray(packed), jnp.asarray([r.size for r in rows], jnp.int32)


class _Prepared(NamedTuple):
  spec: DecodeSpec
  knobs: Knobs
  params: Any
  prompt: jax.Array  # [B', P], B' = B padded to the row shards
  prompt_len: jax.Array  # [B']
  key: jax.Array
  layout: MeshLayout | None
  batch: int  # B: the real rows


_CACHED_METHODS = ("d2f", "threshold", "ar")


def _devices_of(state) -> list:
  leaves = [x for x in jax.tree.leaves(state) if isinstance(x, jax.Array)]
  return sorted(leaves[0].devices(), key=lambda d: d.id) if leaves else jax.local_devices()[:1]


def _prepare(model, prompts, config: DecodeConfig, mask, key, mesh, rules) -> _Prepared:
  if not isinstance(config, DecodeConfig):
    raise TypeError(f"config must be a DecodeConfig, got {type(config).__name__}")
  for attr in ("config", "graphdef", "state"):
    if not hasattr(model, attr):
      raise TypeError(f"model must have .config, .graphdef and .state (a LoadedModel or DecodeModel); "
                      f"{type(model).__name__} has no .{attr}")
  spec, knobs = resolve(config, model.config)
  prompt, prompt_len = pack_prompts(prompts, config, model.config, mask)
  limits.check_positions(model.config, int(prompt_len.max()), spec.max_new_tokens)
  key = jax.random.key(0) if key is None else key
  placement = getattr(model, "placement", None) if mesh is None else as_decode_mesh(mesh, rules)
  if spec.method in _CACHED_METHODS:  # the others keep no cache: their memory is one forward's
    devices = list(placement.mesh.devices.flat) if placement is not None else _devices_of(model.state)
    limits.check_memory(model.config, prompt.shape[0], prompt.shape[1] + spec.max_new_tokens, model.state,
                        devices, config.memory_budget_gib)
  if placement is None:
    return _Prepared(spec, knobs, model.state, prompt, prompt_len, key, None, prompt.shape[0])
  params = place_state(model.state, placement)  # no copy when the model was `shard`ed on this mesh
  padded, padded_len, key, knobs = place_inputs(placement, prompt, prompt_len, key, knobs)
  return _Prepared(spec, knobs, params, padded, padded_len, key, placement.layout, prompt.shape[0])


def _cut(result: DecodeResult, batch: int) -> DecodeResult:
  """Drop the padding rows a mesh needed."""
  return result if result.tokens.shape[0] == batch else jax.tree.map(lambda x: x[:batch], result)


def generate(model, prompt_ids, config: DecodeConfig, *, mask=None, key=None, mesh=None, rules=None
             ) -> DecodeResult:
  """Decode a batch of prompts with `config.method` as one jitted `lax.while_loop`.

  model: anything with .config, .graphdef, .state (a `shard`ed model decodes on its mesh). prompt_ids: list
  of id lists, or [B, T] + `mask`. key: PRNG key for sampling (temperature > 0); default key(0).
  mesh / rules: decode on this jax Mesh (axes data, fsdp, tensor) with these logical-axis rules (default:
  training's); weights not yet there are copied every call, so prefer `model.shard(mesh)` once.
  """
  p = _prepare(model, prompt_ids, config, mask, key, mesh, rules)
  result = _run_loop(model.graphdef, p.params, p.prompt, p.prompt_len, p.key, p.knobs, spec=p.spec,
                     layout=p.layout)
  return _cut(result, p.batch)


def generate_stepwise(model, prompt_ids, config: DecodeConfig, *, mask=None, key=None, mesh=None, rules=None
                      ) -> DecodeResult:
  """The same algorithm and result as `generate`, driven from Python one jitted step at a time."""
  state = p = None
  for state, p in _steps(model, prompt_ids, config, mask, key, mesh, rules):
    pass
  return _cut(_finish(state, p.knobs, spec=p.spec, layout=p.layout), p.batch)


def _steps(model, prompt_ids, config, mask, key, mesh=None, rules=None) -> Iterator[tuple[Any, _Prepared]]:
  p = _prepare(model, prompt_ids, config, mask, key, mesh, rules)
  state, more = _init(model.graphdef, p.params, p.prompt, p.prompt_len, p.key, p.knobs, spec=p.spec,
                      layout=p.layout)
  yield state, p
  while bool(more):  # the host sync the jitted loop avoids
    state, more = _step(model.graphdef, p.params, state, p.knobs, spec=p.spec, layout=p.layout)
    yield state, p


class StreamChunk(NamedTuple):
  ids: list[int]  # newly settled ids
  forwards: int  # forwards so far


def stream(model, prompt_ids: Sequence[int], config: DecodeConfig, *, key=None, mesh=None, rules=None
           ) -> Iterator[StreamChunk]:
  """Yield the ids of one prompt as they settle: the decoded prefix of the response, up to and including
  the first stop token. With d2f the prefix advances as blocks finish, several tokens at a time."""
  emitted = 0
  stops = None
  for state, p in _steps(model, [list(prompt_ids)], config, None, key, mesh, rules):
    spec = p.spec
    if stops is None:
      stops = set(np.asarray(p.knobs.stop_ids).tolist()) - {-1}
    ids = _ALGORITHMS[spec.method].settled(state, spec)
    for i, tok in enumerate(ids):
      if tok in stops:
        ids = ids[:i + 1]
        break
    if len(ids) > emitted:
      yield StreamChunk(ids[emitted:], int(state.forwards[0]) if hasattr(state, "forwards") else int(state.t))
      emitted = len(ids)
    if ids and ids[-1] in stops:
      return


@dataclasses.dataclass(frozen=True)
class DecodeProgram:
  """The jitted decode loop of one (model, config, batch, prompt width, mesh) and abstract arguments for it.

  fn(params, prompt [B, P], prompt_len [B], key, knobs) -> DecodeResult (replicated), the very function
  `generate` runs. args: jax.ShapeDtypeStructs carrying their shardings (params by the rules, rows over
  the batch axes, the rest replicated), so `program.fn.lower(*program.args).compile()` needs no weights
  and no real devices. batch: the rows compiled (the batch asked for, padded to the row shards).
  """

  fn: Callable[..., DecodeResult]
  args: tuple
  spec: DecodeSpec
  batch: int

  def lower(self):
    return self.fn.lower(*self.args)


def decode_program(model, config: DecodeConfig, *, batch: int, prompt_width: int, mesh, rules=None
                   ) -> DecodeProgram:
  """Build the whole jitted decode loop for ahead-of-time compilation.

  model: a ModelConfig (abstract weights are built from it: nothing is allocated), or an object with
  .config, .graphdef and .state (concrete or abstract). config: any DecodeConfig method (d2f, threshold,
  vanilla, dream_vanilla, ar). prompt_width: the padded prompt length P. mesh: a jax Mesh over any devices
  (compile-only topologies included) with axes data / fsdp / tensor; rules default to training's.
  """
  if isinstance(model, ModelConfig):
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(model, rngs=nnx.Rngs(0))))
    model_config = model
  else:
    graphdef, state, model_config = model.graphdef, model.state, model.config
  for name, value in (("batch", batch), ("prompt_width", prompt_width)):
    if not isinstance(value, int) or value <= 0:
      raise ValueError(f"decode_program: {name} must be a positive int, got {value!r}")
  placement = as_decode_mesh(mesh, rules)
  if placement is None:
    raise ValueError("decode_program needs a mesh")
  spec, knobs = resolve(config, model_config)
  rows = placement.padded_batch(batch)
  rep = placement.replicated()

  def sds(x, sharding):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
  pure = jax.tree.map(sds, nnx.to_pure_dict(state), placement.param_shardings(state))
  params = jax.tree.map(lambda x: x, state)
  nnx.replace_by_pure_dict(params, pure)
  args = (params, jax.ShapeDtypeStruct((rows, prompt_width), jnp.int32, sharding=placement.rows(2)),
          jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=placement.rows(1)),
          sds(jax.eval_shape(lambda: jax.random.key(0)), rep), jax.tree.map(lambda x: sds(x, rep), knobs))
  layout = placement.layout

  def fn(params, prompt, prompt_len, key, knobs):
    return _decode(graphdef, params, prompt, prompt_len, key, knobs, spec, layout)
  return DecodeProgram(fn=jax.jit(fn), args=args, spec=spec, batch=rows)
