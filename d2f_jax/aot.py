r"""Ahead-of-time compile check of the distillation step for a target topology, without the hardware.

  python -m d2f_jax.aot --config configs/llada_8b.py:tpu_v5p_64
  python -m d2f_jax.aot --config configs/dream_7b.py:tpu_v5p_64 --topology v5p-64 --remat --json /tmp/aot.json
  python -m d2f_jax.aot --config configs/llada_8b.py:gpu_8xh100 --mesh data=1,fsdp=4,tensor=2
  python -m d2f_jax.aot --config configs/llada_8b.py:gpu_8xa100 --config configs/dream_7b.py:gpu_8xa100
  python -m d2f_jax.aot --config configs/llada_8b.py:tpu_v5p_64 --quick --mesh data=2,fsdp=2,tensor=2

The train step of the config (teacher + student forward, student backward, AdamW update, on the config's
data x fsdp x tensor mesh) is traced over abstract inputs only: `jax.ShapeDtypeStruct`s that carry their
`NamedSharding`s, from `eval_shape`. No weight is ever allocated, so an 8B model is checked on a laptop.
Then it is lowered and compiled for one of two backends:

  tpu  `jax.experimental.topologies.get_topology_desc` gives compile-only devices of a TPU slice (e.g.
       v5p-64 = v5p:2x4x4, 32 chips) and the real TPU compiler runs: its memory analysis is the device's.
       Needs libtpu (`pip install "jax[tpu]"`); used by default when it is installed and the target is a TPU.
  cpu  the fallback that always works: N fake CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=N,
       set before JAX starts, in a child process if JAX is already running with another count). The SPMD
       partitioning, shardings and collectives are the target's; buffer sizes come from the CPU compiler,
       which fuses differently and may upcast bf16 math, so treat them as an estimate (usually high).

Per device it prints the compiled memory analysis (arguments, outputs, aliased, temporaries, generated
code) beside an analytic estimate (frozen weights + trainable + optimizer + gradients + activations), and a
table of what that needs against the HBM of the usual accelerators. Exit status: 0 when every check
compiled (and, with --require_fit, fits the target device), 1 on a compile error, 2 on bad arguments, 3
when --require_fit and the need exceeds the target device's usable HBM.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import time
from typing import Any

GiB = 1 << 30

# Per-device memory (GiB, nominal) of the accelerators a run is usually sized for.
HBM_GIB: dict[str, float] = {
    "v4": 32, "v5e": 16, "v5p": 95, "v6e": 32, "a100-40g": 40, "a100-80g": 80, "h100": 80, "h200": 141,
}
# What XLA leaves a program: the runtime, collectives' scratch and fragmentation take the rest.
USABLE_FRACTION = 0.9

# Hardware presets of train/config.py -> the device they describe.
_HARDWARE_DEVICE = {"tpu_v5p": "v5p", "tpu_v5e": "v5e", "tpu_v6e": "v6e", "tpu_v4": "v4", "gpu_8xa100": "a100-40g",
                    "gpu_8xh100": "h100", "gpu_2x8xh100": "h100", "gpu_8xh200": "h200"}
_FAMILY_8B = {"llada": "llada-8b", "dream": "dream-7b"}


# --- topologies -----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Topology:
  """A target slice: device kind, chip count (= JAX devices), and its TPU topology name if a TPU."""

  name: str  # as given, e.g. "v5p-64"
  kind: str  # key of HBM_GIB
  chips: int
  tpu_name: str | None = None  # "v5p:2x4x4" for get_topology_desc; None for GPUs

  @property
  def is_tpu(self) -> bool:
    return self.tpu_name is not None


def _grid_3d(chips: int) -> list[int]:
  """v4 / v5p slice shapes: 2x2x1, 2x2x2, then double z, y, x in turn (2x2x4, 2x4x4, 4x4x4, 4x4x8 ...)."""
  if chips == 4:
    return [2, 2, 1]
  dims, axis = [2, 2, 2], 2
  while math.prod(dims) < chips:
    dims[axis] *= 2
    axis = (axis - 1) % 3
  return dims


def _grid_2d(chips: int) -> list[int]:
  """v5e / v6e slice shapes: 1x1, 2x2, 2x4, 4x4, 4x8, 8x8, 8x16, 16x16."""
  dims = [1, 1]
  while math.prod(dims) < chips:
    dims[1 if dims[0] == dims[1] else 0] *= 2
  return dims


def parse_topology(name: str) -> Topology:
  """'v5p-64' (TensorCores for v4/v5p, chips for v5e/v6e, as gcloud names them), 'v5litepod-16',
  'v5p:2x4x4', or a GPU host group '8xh100', '2x8xh100', '8xa100-80g'."""
  text = name.strip().lower()
  m = re.fullmatch(r"(?:(\d+)x)?(\d+)x(a100-40g|a100-80g|a100|h100|h200)", text)
  if m:
    hosts, per_host, kind = int(m.group(1) or 1), int(m.group(2)), m.group(3)
    return Topology(name, "a100-40g" if kind == "a100" else kind, hosts * per_host)
  m = re.fullmatch(r"(v4|v5p|v5e|v6e|v5litepod):(\d+(?:x\d+){1,2})", text)
  if m:
    kind = "v5e" if m.group(1) == "v5litepod" else m.group(1)
    dims = [int(d) for d in m.group(2).split("x")]
    return Topology(name, kind, math.prod(dims), f"{kind}:{m.group(2)}")
  m = re.fullmatch(r"(v4|v5p|v5e|v6e|v5litepod)-(\d+)", text)
  if not m:
    raise ValueError(f"unknown topology {name!r}: use e.g. v4-32, v5p-64, v5e-16 (or v5litepod-16), v6e-64, "
                     "v5p:2x4x4, 8xh100, 2x8xh100, 8xa100-80g")
  kind, count = ("v5e" if m.group(1) == "v5litepod" else m.group(1)), int(m.group(2))
  if kind in ("v4", "v5p"):  # named by TensorCores, two per chip (one megacore JAX device)
    if count < 8 or count & (count - 1):
      raise ValueError(f"topology {name!r}: {kind} slices are a power of two of at least 8 TensorCores")
    chips = count // 2
    grid = _grid_3d(chips)
  else:
    if count & (count - 1) or count > 256 or count == 2:
      raise ValueError(f"topology {name!r}: {kind} slices have 1, 4, 8, 16, 32, 64, 128 or 256 chips")
    chips = count
    grid = _grid_2d(chips)
  return Topology(name, kind, chips, f"{kind}:{'x'.join(map(str, grid))}")


def libtpu_available() -> bool:
  return importlib.util.find_spec("libtpu") is not None or bool(os.environ.get("TPU_LIBRARY_PATH"))


def tpu_devices(topology: Topology) -> list:
  """Compile-only devices of a TPU slice (needs libtpu)."""
  from jax.experimental import topologies
  megacore = topology.kind in ("v4", "v5p")
  attempts = [dict(chip_config_name="megacore" if megacore else "default",
                   chips_per_host_bounds=(2, 2, 1) if megacore or topology.chips >= 4 else (1, 1, 1),
                   num_slices=1, wrap=(False, False, False)), {}]
  error = None
  for kwargs in attempts:  # the keyword set the installed libtpu accepts varies by version
    try:
      return list(topologies.get_topology_desc(topology_name=topology.tpu_name, platform="tpu", **kwargs).devices)
    except Exception as e:  # noqa: BLE001 - reported below with both attempts' context
      error = e
  raise RuntimeError(f"get_topology_desc({topology.tpu_name!r}) failed: {error}") from error


# --- arguments ------------------------------------------------------------------------------------

def parse_mesh(text: str) -> dict[str, int]:
  from d2f_jax.train.config import MESH_AXES
  sizes = {}
  for part in filter(None, (p.strip() for p in text.split(","))):
    axis, eq, value = part.partition("=")
    if not eq or axis not in MESH_AXES:
      raise ValueError(f"--mesh {text!r}: expected comma-separated {'=..,'.join(MESH_AXES)}=.. (sizes or -1)")
    try:
      sizes[axis] = int(value)
    except ValueError:
      raise ValueError(f"--mesh {text!r}: size of {axis!r} must be an int, got {value!r}") from None
    if sizes[axis] == 0 or sizes[axis] < -1:
      raise ValueError(f"--mesh {text!r}: size of {axis!r} must be positive or -1")
  return sizes


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m d2f_jax.aot", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", action="append", required=True,
                 help="distillation config 'path.py[:arg]' (repeat to check several, e.g. LLaDA and Dream)")
  p.add_argument("--topology", help="target slice: v4-32, v5p-64, v5e-64, v6e-64, v5p:2x4x4, 8xh100, 2x8xh100 ...")
  p.add_argument("--mesh", help="override the config's mesh: data=..,fsdp=..,tensor=.. (one may be -1)")
  p.add_argument("--devices", type=int, help="device count (default: the topology's chips, else the mesh's product)")
  p.add_argument("--device", choices=sorted(HBM_GIB), help="device kind to size for (default: from the topology "
                                                           "or the config's hardware preset)")
  p.add_argument("--backend", choices=("auto", "tpu", "cpu"), default="auto",
                 help="tpu: compile-only TPU devices (needs libtpu); cpu: fake CPU devices; auto: tpu when possible")
  p.add_argument("--model", help="model preset when the config names no loadable model.path (default: "
                                 "llada-8b / dream-7b from the config file name)")
  p.add_argument("--attention", choices=("xla", "auto", "pallas"),
                 help="attention implementation (default: 'auto' on TPU, the config's elsewhere)")
  p.add_argument("--batch_size", type=int, help="override the global batch")
  p.add_argument("--seq_len", type=int, help="override data.seq_len")
  p.add_argument("--micro_batches", type=int, help="override micro_batches")
  p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                 help="override any config field, e.g. --set loss_chunk=128 --set lora.rank=16")
  p.add_argument("--remat", action="store_true", help="set config.remat: recompute each layer in the backward pass")
  p.add_argument("--top", type=int, default=6, help="list this many of the largest per-device arrays (0: none)")
  p.add_argument("--quick", action="store_true",
                 help="the config's family at tiny size (tiny-llada / tiny-dream), seq_len 64, one row per "
                      "batch shard: checks the mesh and the plumbing in seconds")
  p.add_argument("--no_compile", action="store_true", help="lower only (no memory analysis from the compiler)")
  p.add_argument("--require_fit", action="store_true",
                 help="exit 3 when the per-device need exceeds the target device's usable HBM")
  p.add_argument("--json", help="write the results here")
  return p


def _typed(value: str) -> Any:
  try:
    return ast.literal_eval(value)
  except (ValueError, SyntaxError):
    return value


def load_config(spec: str, args) -> tuple[Any, str, str | None]:
  """(config with the overrides applied, model preset or path, hardware preset in the arg or None)."""
  from d2f_jax.train.config import HARDWARE, load_config_file, validate
  config = load_config_file(spec)
  path, _, arg = spec.partition(":")
  hardware = next((t for t in (x.strip() for x in arg.split(",")) if t in HARDWARE), None)
  with config.unlocked():
    for item in args.set:
      field, eq, value = item.partition("=")
      if not eq:
        raise ValueError(f"--set {item!r}: expected FIELD=VALUE")
      try:
        config.update_from_flattened_dict({field: _typed(value)})
      except (KeyError, AttributeError, TypeError) as e:
        raise ValueError(f"--set {item!r}: {e}") from None
    if args.mesh:
      config.mesh.update({"data": 1, "fsdp": 1, "tensor": 1, **parse_mesh(args.mesh)})
    for field in ("batch_size", "seq_len", "micro_batches"):
      value = getattr(args, field)
      if value is not None:
        (config.data if field == "seq_len" else config)[field] = value
    model = _model_source(config, path, args)
    from d2f_jax.models import PRESETS
    config.model.preset, config.model.path = (model, None) if model in PRESETS else (None, model)
    # The check never reads model.path's weights nor data: make the config valid without them.
    config.model.synthetic = False
    for field in ("path", "tokenizer"):
      if field in config.data and config.data[field] is None:
        config.data[field] = "<not read by the AOT check>"
    if args.remat:
      config.remat = True
    if args.quick:
      config.model.dtype = "float32"
      config.data.seq_len = 64
      config.loss_chunk = 0 if 64 % max(config.loss_chunk, 1) else config.loss_chunk
      config.block_size = min(config.block_size, 16)
  validate(config)
  return config, model, hardware


def _model_source(config, config_path: str, args) -> str:
  """A preset name or an existing model directory; --quick maps to the family's tiny preset."""
  from d2f_jax.models import PRESETS
  source = args.model or config.model.preset or config.model.path
  if source is None:
    base = os.path.basename(config_path).lower()
    family = next((f for f in _FAMILY_8B if f in base), None)
    if family is None:
      raise ValueError(f"{config_path}: no model.preset or model.path, and the file name names no family; "
                       f"pass --model ({', '.join(sorted(PRESETS))}) or --set model.path=DIR")
    source = _FAMILY_8B[family]
  elif source not in PRESETS and not os.path.isdir(source):
    raise ValueError(f"model {source!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor an existing "
                     "directory (only its config.json / d2f_model.json is read); pass --model")
  if args.quick:
    family = _family_of(source)
    source = f"tiny-{family}"
  return source


def _family_of(source: str) -> str:
  from d2f_jax.models import PRESETS
  if source in PRESETS:
    return PRESETS[source].family if PRESETS[source].family in ("llada", "dream") else "llada"
  from d2f_jax import convert
  if convert.is_converted_dir(source):
    return convert.read_converted_meta(source)[0].family
  return convert.read_hf_config(source)[0].family


def model_config_for(config):
  """The base ModelConfig exactly as the trainer builds it (preset / overrides / config.json; dtype; remat),
  without reading any weight."""
  from d2f_jax.train.model import model_config
  remat = bool(config.get("remat", False))
  try:
    return model_config(config.model, remat=remat)
  except TypeError:  # an older model_config without the remat keyword
    return model_config(config.model)


def mesh_devices(mesh: dict, devices: int | None) -> int | None:
  """Devices the mesh needs: its product, or None when an axis is -1 and no count is given."""
  sizes = [int(mesh.get(a, 1)) for a in ("data", "fsdp", "tensor")]
  if -1 in sizes:
    if devices is None:
      return None
    known = math.prod(s for s in sizes if s != -1)
    if devices % known:
      raise ValueError(f"mesh {dict(mesh)} does not divide {devices} devices")
    return devices
  return math.prod(sizes)


# --- memory -----------------------------------------------------------------------------------------

def _per_device_bytes(tree) -> int:
  """Bytes one device holds of a tree of sharded ShapeDtypeStructs (shard shapes, so replication counts)."""
  import jax
  import numpy as np
  total = 0
  for leaf in jax.tree.leaves(tree):
    shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
    total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
  return total


def analytic_estimate(config, models, abstract_state, abstract_frozen, abstract_batch, mesh) -> dict[str, int]:
  """Per-device bytes: weights, trainable, optimizer and gradients exactly from the shardings; activations
  from a count of what the student's backward keeps per layer (no rematerialisation) plus the teacher's
  and the loss's transient buffers. A model of the program, not a measurement: see the compiled numbers."""
  import numpy as np
  mc = models.config
  s = np.dtype(mc.compute_dtype).itemsize
  tokens = abstract_batch["tokens"]
  rows = tokens.sharding.shard_shape(tokens.shape)[0] // config.micro_batches  # rows per device per microbatch
  length = tokens.shape[1]
  tp = mesh.shape.get("tensor", 1)
  split = lambda n: n // tp if n % tp == 0 else n  # noqa: E731 - what tensor parallelism shards
  e, hd, kd, m = mc.embed_dim, mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim, mc.mlp_dim
  # Student, per layer and token: x, norm out, q, k, v, roped q and k, attention out, x after attention,
  # mlp norm out, gate, up, silu(gate) * up; LoRA dropout keeps its dropped input and mask per target.
  per_token = s * (4 * e + 3 * split(hd) + 3 * split(kd) + 3 * split(m)) + 8 * e  # + fp32 norm statistics
  lora = models.lora
  if lora is not None and lora.dropout > 0:
    per_token += len(lora.targets) * e * (s + 1)
  reference_attention = getattr(mc, "attention_impl", "xla") == "xla"
  heads = split(mc.num_heads)
  attention_per_token = (2 * heads * length * 4) if reference_attention else heads * 8  # scores+probs | lse
  layers = mc.num_layers
  one_layer = rows * length * (per_token + attention_per_token)  # the teacher's forward: one layer at a time
  if getattr(mc, "remat", False):  # only each layer's input is kept; the backward recomputes one layer
    student = layers * rows * length * e * s + one_layer
  else:
    student = layers * one_layer
  hidden = 2 * rows * length * e * s
  chunk = config.loss_chunk or length
  logits = rows * chunk * split(mc.vocab_size) * 4 * 6  # t, s logits, two log-softmaxes, p, and a product
  trainable = _per_device_bytes(abstract_state.params)
  return {
      "frozen_weights": _per_device_bytes(abstract_frozen),
      "trainable": trainable,
      "optimizer": _per_device_bytes(abstract_state.opt_state),
      "gradients": trainable * (2 if config.micro_batches > 1 else 1),  # + the scan's accumulator
      "batch": _per_device_bytes(abstract_batch),
      "activations": student + one_layer + hidden + logits,
      "attention_scores": (layers if not getattr(mc, "remat", False) else 1) * rows * length * attention_per_token
                          if reference_attention else 0,
  }


_HLO_SHAPE = re.compile(r"\b(pred|s4|u4|s8|u8|s16|u16|s32|u32|s64|u64|f8e4m3fn|f8e5m2|f16|bf16|f32|f64)\[([0-9,]*)\]")
_HLO_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2,
              "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}


def largest_arrays(hlo_text: str, top: int) -> list[tuple[str, int]]:
  """The `top` largest distinct array shapes of a compiled (per-device) HLO module, with their bytes: where the
  memory goes, e.g. activations whose batch is less sharded than the mesh allows."""
  sizes = {}
  for dtype, dims in _HLO_SHAPE.findall(hlo_text):
    shape = f"{dtype}[{dims}]"
    if shape not in sizes:
      sizes[shape] = int(math.prod(int(d) for d in dims.split(",") if d) * _HLO_BYTES[dtype])
  return sorted(sizes.items(), key=lambda kv: -kv[1])[:top]


def compiled_memory(compiled) -> dict[str, int] | None:
  try:
    stats = compiled.memory_analysis()
  except Exception:  # noqa: BLE001 - some backends do not implement it
    return None
  if stats is None:
    return None
  get = lambda name: int(getattr(stats, name, 0) or 0)  # noqa: E731
  out = {"arguments": get("argument_size_in_bytes"), "outputs": get("output_size_in_bytes"),
         "aliased": get("alias_size_in_bytes"), "temporaries": get("temp_size_in_bytes"),
         "generated_code": get("generated_code_size_in_bytes")}
  out["total"] = out["arguments"] + out["outputs"] - out["aliased"] + out["temporaries"] + out["generated_code"]
  return out


# --- the check ----------------------------------------------------------------------------------------

def check(config, source: str, devices: list, *, backend: str, attention: str | None, lower_only: bool = False,
          one_row_per_shard: bool = False, top: int = 0, log=print) -> dict:
  """Lower (and compile) the train step of `config` on `devices` with abstract inputs; returns the report.

  one_row_per_shard: replace the global batch by one row per batch shard and micro batch (--quick)."""
  import jax
  import jax.numpy as jnp
  from d2f_jax.train import sharding
  from d2f_jax.train.model import DistillModels
  from d2f_jax.train.optim import OptimSpec
  from d2f_jax.train.schedule import Schedule
  from d2f_jax.train.state import abstract_state
  from d2f_jax.train.step import StepSpec, compiled_train_step
  from d2f_jax.train.trainer import _rules, lora_config

  mc = model_config_for(config)
  if attention is not None and hasattr(mc, "attention_impl"):
    mc = mc.replace(attention_impl=attention)
  mesh = sharding.make_mesh(config.mesh, devices)
  rules = _rules(config)
  models = DistillModels.create(mc, lora_config(config), config.train_dtype)
  batch_sh = sharding.batch_sharding(mesh, rules)
  shards = math.prod(mesh.shape[a] for a in (batch_sh.spec[0] if isinstance(batch_sh.spec[0], tuple)
                                             else (batch_sh.spec[0],)) if a)
  if one_row_per_shard:
    config = config.copy_and_resolve_references()
    config.batch_size = shards * config.micro_batches
  if config.batch_size % (shards * config.micro_batches):
    raise ValueError(f"batch_size={config.batch_size} must be a multiple of the {shards} batch shards x "
                     f"{config.micro_batches} micro batches")
  spec = StepSpec(models=models, schedule=Schedule(**config.schedule.to_dict()),
                  optim=OptimSpec.from_config(config.optim), block_size=config.block_size,
                  micro_batches=config.micro_batches, loss_chunk=config.loss_chunk, batch_sharding=batch_sh)
  # Everything abstract: eval_shape'd trees with their shardings. No parameter is materialised.
  state = abstract_state(models, spec.optim, mesh, rules)
  from d2f_jax.train.model import _pure_abstract
  frozen_sh = sharding.state_shardings(models.abstract_frozen(), mesh, rules)
  frozen = sharding.abstract_with(_pure_abstract(models.abstract_frozen()), frozen_sh)
  batch = {"tokens": jax.ShapeDtypeStruct((config.batch_size, config.data.seq_len), jnp.int32, sharding=batch_sh),
           "prompt_len": jax.ShapeDtypeStruct((config.batch_size,), jnp.int32,
                                              sharding=sharding.batch_sharding(mesh, rules, 1))}
  step = compiled_train_step(spec, mesh, rules)
  report: dict[str, Any] = {
      "model": source, "family": mc.family, "dtype": mc.dtype, "attention_impl": getattr(mc, "attention_impl", "xla"),
      "remat": bool(getattr(mc, "remat", False)),
      "finetune": config.finetune, "backend": backend, "device_kind": str(devices[0].device_kind),
      "devices": len(devices), "mesh": dict(mesh.shape), "batch_size": config.batch_size,
      "seq_len": config.data.seq_len, "micro_batches": config.micro_batches, "loss_chunk": config.loss_chunk,
      "block_size": config.block_size,
      "params": {"frozen": sum(math.prod(x.shape) for x in jax.tree.leaves(frozen)),
                 "trainable": sum(math.prod(x.shape) for x in jax.tree.leaves(state.params))},
  }
  t0 = time.perf_counter()
  lowered = step.lower(state, frozen, batch)
  report["lower_s"] = round(time.perf_counter() - t0, 2)
  log(f"  lowered in {report['lower_s']:.1f}s")
  report["analytic"] = analytic_estimate(config, models, state, frozen, batch, mesh)
  report["analytic"]["total"] = sum(v for k, v in report["analytic"].items() if k != "attention_scores")
  report["compiled"] = None
  if not lower_only:
    t0 = time.perf_counter()
    compiled = lowered.compile()
    report["compile_s"] = round(time.perf_counter() - t0, 2)
    log(f"  compiled in {report['compile_s']:.1f}s")
    report["compiled"] = compiled_memory(compiled)
    if top:
      try:
        report["largest_arrays"] = largest_arrays(compiled.as_text(), top)
      except Exception:  # noqa: BLE001 - diagnostics only
        pass
    try:
      cost = compiled.cost_analysis()
      cost = cost[0] if isinstance(cost, (list, tuple)) else cost
      report["flops_per_device"] = float(cost.get("flops", 0.0)) if cost else None
    except Exception:  # noqa: BLE001
      report["flops_per_device"] = None
  return report


def needed_bytes(report: dict) -> int:
  """The per-device need: the compiler's total when there is one, else the analytic estimate."""
  return (report["compiled"] or {}).get("total") or report["analytic"]["total"]


def _size(n: int | float | None) -> str:
  if n is None:
    return "-"
  for unit, scale in (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
    if abs(n) >= scale:
      return f"{n / scale:.2f} {unit}"
  return f"{int(n)} B"


def format_report(report: dict, target: str | None) -> str:
  lines = []
  p = report["params"]
  lines.append(f"model {report['model']} ({report['family']}, {report['dtype']}, attention {report['attention_impl']}"
               f"{', remat' if report.get('remat') else ''}), {report['finetune']}: {p['frozen'] / 1e9:.3f}B frozen + "
               f"{p['trainable'] / 1e6:.2f}M trainable params")
  lines.append(f"mesh {report['mesh']} on {report['devices']} x {report['device_kind']} ({report['backend']} backend); "
               f"batch {report['batch_size']} x {report['seq_len']} tokens, {report['micro_batches']} micro batch(es), "
               f"loss_chunk {report['loss_chunk']}")
  lines.append("per-device memory:")
  compiled = report["compiled"]
  if compiled:
    lines.append("  compiled  " + ", ".join(f"{k} {_size(v)}" for k, v in compiled.items()))
  else:
    lines.append("  compiled  (not available: --no_compile, or the backend has no memory analysis)")
  a = report["analytic"]
  lines.append("  analytic  " + ", ".join(f"{k} {_size(v)}" for k, v in a.items() if k != "attention_scores"))
  if a.get("attention_scores"):
    lines.append(f"  note: the XLA reference attention keeps [B, H, T, T] scores ({_size(a['attention_scores'])} of "
                 "the activations); the Pallas flash kernel (--attention auto on GPU/TPU) does not")
  if report.get("largest_arrays"):
    lines.append("  largest arrays: " + ", ".join(f"{shape} {_size(n)}" for shape, n in report["largest_arrays"]))
  if report["backend"] == "cpu" and compiled:
    lines.append("  note: buffer sizes from the CPU compiler on fake devices; the TPU/GPU compiler's differ (CPU may "
                 "upcast bf16 math to f32)")
  need = needed_bytes(report)
  lines.append(f"{'device':<10} {'HBM GiB':>8} {'usable':>8} {'needed':>9} {'use':>6}  verdict")
  for kind, hbm in HBM_GIB.items():
    usable = hbm * GiB * USABLE_FRACTION
    verdict = "fits" if need <= usable else "DOES NOT FIT"
    mark = "  <- target" if kind == target else ""
    lines.append(f"{kind:<10} {hbm:>8.0f} {usable / GiB:>8.1f} {need / GiB:>9.3f} {100 * need / (hbm * GiB):>5.0f}%  "
                 f"{verdict}{mark}")
  return "\n".join(lines)


# --- process set-up ---------------------------------------------------------------------------------

def _peak_rss_bytes() -> int | None:
  try:
    import resource
  except ImportError:  # not on POSIX
    return None
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux


def _jax_device_count_flag(n: int) -> str:
  flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")).strip()
  return f"{flags} --xla_force_host_platform_device_count={n}".strip()


def _fake_cpu_devices(n: int) -> list | None:
  """n CPU devices: set up before JAX's backends start (importing jax does not start them); None when they
  already run with another count."""
  import jax
  from jax._src import xla_bridge
  if not xla_bridge.backends_are_initialized():
    os.environ["XLA_FLAGS"] = _jax_device_count_flag(n)
    jax.config.update("jax_platforms", "cpu")
  try:
    devices = jax.devices("cpu")
  except RuntimeError:
    return None
  return devices if len(devices) == n else None


def _run_child(argv: list[str], n: int) -> int:
  env = dict(os.environ, XLA_FLAGS=_jax_device_count_flag(n), JAX_PLATFORMS="cpu", D2F_AOT_CHILD="1")
  return subprocess.call([sys.executable, "-m", "d2f_jax.aot", *argv], env=env)


def _patch_kernel_platform(platform: str) -> None:
  """The attention kernels dispatch on the default backend; compile-only TPU devices are not it."""
  try:
    from d2f_jax.kernels import common
  except ImportError:
    return
  if hasattr(common, "_platform"):
    common._platform = lambda: platform


def main(argv: list[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = build_parser()
  args = parser.parse_args(argv)
  try:
    topology = parse_topology(args.topology) if args.topology else None
    if args.devices is not None and args.devices <= 0:
      raise ValueError(f"--devices must be positive, got {args.devices}")
    if args.mesh:
      parse_mesh(args.mesh)
    configs = [(spec, *load_config(spec, args)) for spec in args.config]
  except (ValueError, FileNotFoundError, KeyError) as e:
    parser.error(str(e))

  count = args.devices or (topology.chips if topology else None)
  for spec, config, _, _ in configs:
    try:
      need = mesh_devices(config.mesh, count)
    except ValueError as e:
      parser.error(f"{spec}: {e}")
    if need is None:
      parser.error(f"{spec}: mesh {dict(config.mesh)} has a -1 axis; pass --topology or --devices")
    if count is None:
      count = need
    elif need != count:
      parser.error(f"{spec}: mesh {dict(config.mesh)} needs {need} devices, the target has {count}; "
                   "adjust --mesh (or --topology / --devices)")

  backend = args.backend
  if backend in ("auto", "tpu"):
    tpu_target = topology is not None and topology.is_tpu
    if backend == "tpu" and not tpu_target:
      parser.error("--backend tpu needs a TPU --topology (e.g. v5p-64)")
    if tpu_target and libtpu_available():
      backend = "tpu"
    elif backend == "tpu":
      parser.error("--backend tpu: libtpu is not installed, so there is no TPU compiler here "
                   "(pip install 'jax[tpu]'); drop --backend to compile on fake CPU devices instead")
    else:
      if tpu_target:
        print(f"libtpu is not installed: compiling for {topology.name} on {count} fake CPU devices instead "
              "(pip install 'jax[tpu]' for the TPU compiler's own memory analysis)", file=sys.stderr)
      backend = "cpu"

  if backend == "cpu":
    devices = _fake_cpu_devices(count)
    if devices is None:  # JAX already runs here with another device count: a fresh process gets its own
      if os.environ.get("D2F_AOT_CHILD"):
        parser.error(f"could not get {count} fake CPU devices (XLA_FLAGS={os.environ.get('XLA_FLAGS')!r})")
      return _run_child(argv, count)
  else:
    import jax
    from jax._src import xla_bridge
    if not xla_bridge.backends_are_initialized():
      jax.config.update("jax_platforms", "cpu")  # this host has no TPU: the slice's devices are compile-only
    try:
      devices = tpu_devices(topology)
    except RuntimeError as e:
      print(f"error: no compile-only TPU devices for {topology.name}: {e}\n"
            "(--backend cpu compiles on fake CPU devices instead)", file=sys.stderr)
      return 1
    _patch_kernel_platform("tpu")
    if len(devices) != count:
      parser.error(f"topology {topology.name} has {len(devices)} devices, the mesh needs {count}")

  results, status = [], 0
  for spec, config, source, hardware in configs:
    target = args.device or (topology.kind if topology else None) or next(
        (v for k, v in _HARDWARE_DEVICE.items() if hardware and hardware.startswith(k)), None)
    attention = args.attention or ("auto" if backend == "tpu" else None)
    print(f"== {spec}{' (quick)' if args.quick else ''}: train step for {target or 'an unspecified device'}")
    try:
      report = check(config, source, devices, backend=backend, attention=attention, lower_only=args.no_compile,
                     one_row_per_shard=args.quick, top=args.top)
    except Exception as e:  # noqa: BLE001 - a compile failure is the finding; report it and go on
      print(f"  FAILED: {type(e).__name__}: {e}")
      results.append({"config": spec, "error": f"{type(e).__name__}: {e}"})
      status = 1
      continue
    report.update(config=spec, target=target, topology=topology.name if topology else None, quick=args.quick)
    if target:
      usable = HBM_GIB[target] * GiB * USABLE_FRACTION
      report["fits_target"] = needed_bytes(report) <= usable
      if args.require_fit and not report["fits_target"] and status == 0:
        status = 3
    report["needed_bytes"] = needed_bytes(report)
    report["host_peak_rss_bytes"] = _peak_rss_bytes()  # what the check itself took on this machine
    print(format_report(report, target))
    print()
    results.append(report)

  if args.json:
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
      json.dump({"hbm_gib": HBM_GIB, "usable_fraction": USABLE_FRACTION, "results": results}, f, indent=2,
                default=str)
      f.write("\n")
    print(f"wrote {args.json}")
  return status


if __name__ == "__main__":
  sys.exit(main())
