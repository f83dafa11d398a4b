"""The programs the compile tier builds over abstract inputs: the train step of a config, and the whole jitted
decode loop (D2F, AR) of the config's model.

Every input is a `jax.ShapeDtypeStruct` carrying its `NamedSharding` on the target's devices, so nothing
is allocated (an 8B model is compiled on a laptop) and the program is the one the product runs: the train
step comes from the same `spec_from_config` + `compiled_train_step` the Trainer uses; the decode loop from
`decode.runner.decode_program`, the function `generate` jits.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

PROGRAMS = ("train", "d2f_decode", "ar_decode", "llada2_decode", "serve", "llada2_serve")
SERVE_METHODS = {"serve": "d2f", "llada2_serve": "llada2"}  # --program -> the engine's method


@dataclasses.dataclass(frozen=True)
class Program:
  """A jitted function, its abstract arguments, and what it is (for the report)."""

  name: str
  fn: Any
  args: tuple
  mesh: dict
  shape: dict  # batch / sequence sizes of the program, for the report

  def lower(self):
    return self.fn.lower(*self.args)


def model_config_of(config, attention: str | None):
  """The base ModelConfig exactly as the Trainer builds it (preset / overrides / config.json, dtype, remat),
  with `attention` (or config.model.attention_impl, where the config has it) as its attention_impl."""
  from d2f_jax.train.model import model_config
  mc = model_config(config.model, remat=bool(config.get("remat", False)))
  impl = attention or config.model.get("attention_impl")
  return mc.replace(attention_impl=impl) if impl else mc


def train_program(config, devices: list, *, attention: str | None = None) -> Program:
  """The config's train step (its objective, LoRA or full, micro batches) on its mesh over `devices`."""
  import jax
  import jax.numpy as jnp

  from d2f_jax import sharding
  from d2f_jax.train import objectives
  from d2f_jax.train.model import TrainModels, pure_abstract
  from d2f_jax.train.state import abstract_state
  from d2f_jax.train.step import compiled_train_step, spec_from_config
  from d2f_jax.train.trainer import lora_config

  mc = model_config_of(config, attention)
  mesh = sharding.make_mesh(config.mesh, devices)
  rules = sharding.normalize_rules(config.logical_axis_rules)
  models = TrainModels.create(mc, lora_config(config), config.train_dtype,
                              teacher=objectives.get(config.objective).teacher)
  spec = spec_from_config(config, models, mesh, rules)
  shards = math.prod(mesh.shape[a] for a in _axes(spec.batch_sharding.spec[0]))
  if config.batch_size % (shards * config.micro_batches):
    raise ValueError(f"config.batch_size={config.batch_size} must be a multiple of the {shards} batch shards x "
                     f"{config.micro_batches} micro batches")
  state = abstract_state(models, spec.optim, mesh, rules)
  frozen = {}
  if models.keeps_base:
    base = models.abstract_frozen()
    frozen = sharding.abstract_with(pure_abstract(base), sharding.state_shardings(base, mesh, rules))
  rows, length = config.batch_size, config.data.seq_len
  batch = {"tokens": jax.ShapeDtypeStruct((rows, length), jnp.int32, sharding=spec.batch_sharding),
           "prompt_len": jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=sharding.batch_sharding(mesh, rules, 1))}
  shape = {"objective": config.objective, "finetune": config.finetune, "batch": rows, "seq_len": length,
           "micro_batches": config.micro_batches, "remat": bool(mc.remat)}
  return Program("train", compiled_train_step(spec, mesh, rules), (state, frozen, batch), dict(mesh.shape), shape)


def _axes(entry) -> tuple:
  if entry is None:
    return ()
  return tuple(a for a in (entry if isinstance(entry, tuple) else (entry,)) if a)


def decode_mesh_shape(mc, devices: int) -> dict:
  """data x tensor for decoding `mc` on `devices` devices: heads over the largest power of two that divides
  the query heads (weights and the KV cache split by heads), the rest over rows."""
  tensor = 1
  while tensor * 2 <= devices and devices % (tensor * 2) == 0 and mc.num_heads % (tensor * 2) == 0:
    tensor *= 2
  return {"data": devices // tensor, "fsdp": 1, "tensor": tensor}


def decode_program(config, devices: list, *, method: str, batch: int, prompt_len: int, new_tokens: int,
                   block_size: int, attention: str | None = None, mesh_shape: dict | None = None,
                   rules=None, block_cache: bool = False) -> Program:
  """The whole jitted decode loop of the config's model (`method` 'd2f', 'ar' or 'llada2', the last with its
  `block_cache` or without), over `devices`."""
  from d2f_jax.decode.config import DecodeConfig
  from d2f_jax.decode.runner import decode_program as build
  from d2f_jax import sharding

  mc = model_config_of(config, attention)
  sizes = mesh_shape or decode_mesh_shape(mc, len(devices))
  mesh = sharding.make_mesh(sizes, devices)
  decode = DecodeConfig(method=method, block_size=block_size, max_new_tokens=new_tokens,
                        prompt_buckets=prompt_len, block_cache=block_cache)
  built = build(mc, decode, batch=batch, prompt_width=prompt_len, mesh=mesh,
                rules=rules if rules is not None else config.get("logical_axis_rules"))
  shape = {"batch": batch, "rows_compiled": built.batch, "prompt_len": prompt_len, "new_tokens": new_tokens,
           "block_size": block_size, **({"block_cache": True} if block_cache else {})}
  return Program(f"{method}_decode", built.fn, built.args, dict(mesh.shape), shape)


def serve_programs(config, devices: list, *, slots: int, prompt_len: int, new_tokens: int, block_size: int,
                   attention: str | None = None, mesh_shape: dict | None = None, rules=None,
                   method: str = "d2f", block_cache: bool = False) -> list[Program]:
  """The serving engine's two programs for the config's model: `serve_advance` (k D2F steps over every slot)
  and `serve_insert` (the prefill of max_insert requests at the largest prompt bucket into their slots), slots
  over rows; a 'llada2' engine's (the released sampler: every step recomputes each slot) are named
  `llada2_serve_advance` / `llada2_serve_insert` (`block_cache`: its finished blocks cached)."""
  from d2f_jax import sharding
  from d2f_jax.serve import EngineConfig
  from d2f_jax.serve.aot import engine_programs

  mc = model_config_of(config, attention)
  mesh = sharding.make_mesh(mesh_shape or decode_mesh_shape(mc, len(devices)), devices)
  engine = EngineConfig(slots=slots, method=method, block_size=block_size, max_new_tokens=new_tokens,
                        max_prompt_len=prompt_len, prompt_bucket=min(64, prompt_len), block_cache=block_cache)
  built = engine_programs(mc, engine, mesh, rules if rules is not None else config.get("logical_axis_rules"))
  shape = {"slots": slots, "prompt_len": engine.prompt_width, "new_tokens": new_tokens, "block_size": block_size,
           "steps_per_call": engine.steps_per_call, "insert_batch": engine.insert_sizes[-1],
           **({"block_cache": True} if block_cache else {})}
  prefix = "" if method == "d2f" else f"{method}_"
  return [Program(prefix + name, fn, args, dict(mesh.shape), shape) for name, (fn, args) in built.items()]
