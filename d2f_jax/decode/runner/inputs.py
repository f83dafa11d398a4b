"""A decode call's inputs made ready: config resolved, prompts packed, limits checked, rows placed on the mesh.

`prepare` returns everything the jitted programs take (`Prepared`); `cut_padding` drops the padding rows a mesh
needed from the result.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from d2f_jax import xla_maps
from d2f_jax.decode import limits
from d2f_jax.decode.config import DecodeConfig, DecodeSpec, Knobs, resolve
from d2f_jax.decode.mesh import as_decode_mesh, place_inputs, place_state
from d2f_jax.decode.result import DecodeResult
from d2f_jax.models import ModelConfig
from d2f_jax.sharding.layout import MeshLayout


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


class Prepared(NamedTuple):
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


@functools.lru_cache(maxsize=64)
def _resolved(config: DecodeConfig, model_config: ModelConfig) -> tuple[DecodeSpec, Knobs]:
  """`resolve` once per (config, model config): its knobs are six small device arrays, and making them afresh
  cost every batch-1 generate call about 0.2 ms of host time."""
  return resolve(config, model_config)


@functools.cache
def _default_key() -> jax.Array:
  return jax.random.key(0)


def prepare(model, prompts, config: DecodeConfig, mask, key, mesh, rules) -> Prepared:
  if not isinstance(config, DecodeConfig):
    raise TypeError(f"config must be a DecodeConfig, got {type(config).__name__}")
  for attr in ("config", "graphdef", "state"):
    if not hasattr(model, attr):
      raise TypeError(f"model must have .config, .graphdef and .state (a d2f_jax.Model); "
                      f"{type(model).__name__} has no .{attr}")
  xla_maps.ensure_headroom()  # a sweep of decode settings compiles program after program (xla_maps.py)
  try:
    spec, knobs = _resolved(config, model.config)
  except TypeError:  # a field value that cannot be hashed: resolve this config afresh
    spec, knobs = resolve(config, model.config)
  prompt, prompt_len = pack_prompts(prompts, config, model.config, mask)
  limits.check_positions(model.config, int(prompt_len.max()), spec.max_new_tokens)
  key = _default_key() if key is None else key
  placement = getattr(model, "placement", None) if mesh is None else as_decode_mesh(mesh, rules)
  if spec.method in _CACHED_METHODS:  # the others keep no cache: their memory is one forward's
    devices = list(placement.mesh.devices.flat) if placement is not None else _devices_of(model.state)
    limits.check_memory(model.config, prompt.shape[0], prompt.shape[1] + spec.max_new_tokens, model.state,
                        devices, config.memory_budget_gib)
  if placement is None:
    return Prepared(spec, knobs, model.state, prompt, prompt_len, key, None, prompt.shape[0])
  params = place_state(model.state, placement)  # no copy when the model was `shard`ed on this mesh
  padded, padded_len, key, knobs = place_inputs(placement, prompt, prompt_len, key, knobs)
  return Prepared(spec, knobs, params, padded, padded_len, key, placement.layout, prompt.shape[0])


def cut_padding(result: DecodeResult, batch: int) -> DecodeResult:
  """Drop the padding rows a mesh needed."""
  return result if result.tokens.shape[0] == batch else jax.tree.map(lambda x: x[:batch], result)
