"""The engine's device programs over abstract, sharded inputs, for ahead-of-time compilation (`python -m
d2f_jax.aot --program serve`): nothing is allocated, so an 8B engine with 32 slots compiles for a target on a
laptop and reports its memory per device.

Slots split over the batch axes and heads over the head axis, as `generate` places its rows; the slot state
(token buffers, KV cache [L, S, P + N, K, D], counters) and the per-slot knobs carry those shardings.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from d2f_jax.decode.config import resolve
from d2f_jax.decode.mesh import as_decode_mesh
from d2f_jax.models import KVCache, ModelConfig, abstract_model, with_shardings
from d2f_jax.serve.programs import Admission, SlotPrograms, advance_slots, insert_rows
from d2f_jax.serve.config import EngineConfig


def _abstract_params(model_config: ModelConfig, placement):
  graphdef, state = nnx.split(abstract_model(model_config))
  return graphdef, with_shardings(state, placement.param_shardings(state))


def _slot_shardings(tree, placement, slots: int):
  """Every [S, ...] leaf split by rows, the KV cache by rows and kv heads, scalars replicated."""
  layout = placement.layout
  rows = layout.batch_split(slots) or None

  def one(x):
    if isinstance(x, KVCache):
      heads = layout.head_axis if x.k.shape[3] % layout.head_size() == 0 else None
      kv = NamedSharding(placement.mesh, P(None, rows, None, heads, None))
      row2 = NamedSharding(placement.mesh, P(rows, None))
      return KVCache(k=_sds(x.k, kv), v=_sds(x.v, kv), ids=_sds(x.ids, row2),
                     length=_sds(x.length, NamedSharding(placement.mesh, P(rows))))
    spec = P(rows, *([None] * (x.ndim - 1))) if x.ndim and x.shape[0] == slots else P()
    return _sds(x, NamedSharding(placement.mesh, spec))
  return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, KVCache))


def _sds(x, sharding):
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def engine_programs(model_config: ModelConfig, config: EngineConfig, mesh, rules=None) -> dict:
  """{'serve_advance': (fn, args), 'serve_insert': (fn, args)}: the engine's advance program and its insert
  program at the largest prompt bucket and admission count (its most memory), each
  `fn.lower(*args).compile()`-able on `mesh`'s devices (the engine's own jitted programs, their static
  context first)."""
  placement = as_decode_mesh(mesh, rules)
  if placement is None:
    raise ValueError("engine_programs needs a mesh")
  spec, knobs = resolve(config.decode_config(), model_config)
  graphdef, params = _abstract_params(model_config, placement)
  programs = SlotPrograms(graphdef, spec, placement.layout, config.steps_per_call)
  batch = jax.eval_shape(lambda: programs.empty(config.slots, config.prompt_width, knobs))
  batch = _slot_shardings(batch, placement, config.slots)
  rep = NamedSharding(placement.mesh, P())
  size = config.insert_sizes[-1]

  def rows(shape, dtype):
    return _sds(jax.ShapeDtypeStruct(shape, dtype), rep)
  admission = Admission(slots=rows((size,), jnp.int32), prompt=rows((size, config.prompt_width), jnp.int32),
                        prompt_len=rows((size,), jnp.int32), seeds=rows((size,), jnp.uint32),
                        knobs=jax.tree.map(lambda x: rows((size,) + x.shape, x.dtype), knobs))
  return {"serve_advance": (advance_slots, (programs, params, batch)),
          "serve_insert": (insert_rows, (programs, params, batch, admission))}
