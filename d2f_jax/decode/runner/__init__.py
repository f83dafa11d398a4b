"""Public entry points: `generate` (one jitted while_loop per call) and host-driven stepping / streaming.

Every method implements init / step / running / finish over its own loop state; `generate` runs them as
init + `lax.while_loop` + finish inside one jit, so a whole generation is a single device program with no
host sync per step. `generate_stepwise` and `stream` drive the very same step function from Python (one
jitted call and one host sync per step): used for streaming text and to measure what the loop saves.

On a mesh (`model.shard(mesh)` or `mesh=`), weights sit in training's shardings, rows are padded to the row
shards and split over them, and the whole loop is traced inside `mesh_layout` (decode/mesh.py), so attention
kernels run in shard_map. `decode_program` builds the same jitted loop over abstract inputs for
ahead-of-time compilation.

Here (the package's public face): the entry points. Copies of a model handle are model.py, input preparation
inputs.py, the jitted programs programs.py and the ahead-of-time builder aot.py; the handle itself is
d2f_jax.api.Model.
"""

from __future__ import annotations

from typing import Any, Iterator, NamedTuple, Sequence

import numpy as np

from d2f_jax.decode.config import DecodeConfig, resolve
from d2f_jax.decode.result import DecodeResult
from d2f_jax.decode.runner.aot import DecodeProgram, decode_program
from d2f_jax.decode.runner.model import shard_model, with_attention
from d2f_jax.decode.runner.inputs import Prepared, cut_padding, pack_prompts, prepare
from d2f_jax.decode.runner.programs import (ALGORITHMS, finish_program, init_program, run_loop, step_program,
                                           trace_count)

__all__ = [
    "DecodeProgram", "StreamChunk", "decode_program", "generate", "generate_stepwise",
    "pack_prompts", "resolve", "shard_model", "stream", "trace_count", "with_attention",
]


def generate(model, prompt_ids, config: DecodeConfig, *, mask=None, key=None, mesh=None, rules=None
             ) -> DecodeResult:
  """Decode a batch of prompts with `config.method` as one jitted `lax.while_loop`.

  model: anything with .config, .graphdef, .state (a `shard`ed model decodes on its mesh). prompt_ids: list
  of id lists, or [B, T] + `mask`. key: PRNG key for sampling (temperature > 0); default key(0).
  mesh / rules: decode on this jax Mesh (axes data, fsdp, tensor) with these logical-axis rules (default:
  training's); weights not yet there are copied every call, so prefer `model.shard(mesh)` once.
  """
  p = prepare(model, prompt_ids, config, mask, key, mesh, rules)
  result = run_loop(model.graphdef, p.params, p.prompt, p.prompt_len, p.key, p.knobs, spec=p.spec,
                     layout=p.layout)
  return cut_padding(result, p.batch)


def generate_stepwise(model, prompt_ids, config: DecodeConfig, *, mask=None, key=None, mesh=None, rules=None
                      ) -> DecodeResult:
  """The same algorithm and result as `generate`, driven from Python one jitted step at a time."""
  state = p = None
  for state, p in _steps(model, prompt_ids, config, mask, key, mesh, rules):
    pass
  return cut_padding(finish_program(state, p.knobs, spec=p.spec, layout=p.layout), p.batch)


def _steps(model, prompt_ids, config, mask, key, mesh=None, rules=None) -> Iterator[tuple[Any, Prepared]]:
  p = prepare(model, prompt_ids, config, mask, key, mesh, rules)
  state, more = init_program(model.graphdef, p.params, p.prompt, p.prompt_len, p.key, p.knobs, spec=p.spec,
                      layout=p.layout)
  yield state, p
  while bool(more):  # the host sync the jitted loop avoids
    state, more = step_program(model.graphdef, p.params, state, p.knobs, spec=p.spec, layout=p.layout)
    yield state, p


class StreamChunk(NamedTuple):
  ids: list[int]  # newly settled ids
  forwards: int  # forwards so far


def stream(model, prompt_ids: Sequence[int], config: DecodeConfig, *, key=None, mesh=None, rules=None
           ) -> Iterator[StreamChunk]:
  """Yield the ids of one prompt as they settle: the decoded prefix of the response, up to and including
  the first stop token. With d2f the prefix advances as blocks finish, several tokens at a time."""
  emitted = 0
  stop_ids = None
  for state, p in _steps(model, [list(prompt_ids)], config, None, key, mesh, rules):
    spec = p.spec
    if stop_ids is None:
      stop_ids = set(np.asarray(p.knobs.stop_ids).tolist()) - {-1}
    ids = ALGORITHMS[spec.method].settled(state, spec)
    for i, tok in enumerate(ids):
      if tok in stop_ids:
        ids = ids[:i + 1]
        break
    if len(ids) > emitted:
      yield StreamChunk(ids[emitted:], int(state.forwards[0]) if hasattr(state, "forwards") else int(state.t))
      emitted = len(ids)
    if ids and ids[-1] in stop_ids:
      return
