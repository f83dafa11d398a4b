r"""The compile tier: compile the product's programs with the real TPU or NVIDIA compiler, without the hardware.

  python -m d2f_jax.aot --target v5p-64 --config configs/llada_8b.py:tpu_v5p_64 --program train
  python -m d2f_jax.aot --target 8xh100 --config configs/dream_7b.py:gpu_8xh100 --program train --json out.json
  python -m d2f_jax.aot --target v5e-8 --config configs/llada_8b.py --program d2f_decode --program ar_decode
  python -m d2f_jax.aot --target h100 --config configs/dream_7b.py --program d2f_decode --batch 1,32
  python -m d2f_jax.aot --target cpu-8 --config configs/llada_8b.py:tpu_v5p_64 --quick --mesh data=2,fsdp=2,tensor=2

Programs: `train` is the config's train step (its objective; teacher + LoRA student for distill) built by the
Trainer's own `train.step.spec_from_config` and `compiled_train_step`; `d2f_decode` / `ar_decode` are the whole
jitted decode loop `generate` runs (`decode.runner.decode_program`; default prompt 512, 256 new tokens,
block 32, batch 1 and 32). Inputs are abstract (`jax.ShapeDtypeStruct` + sharding): no weight is allocated.

Targets: TPU slices (v4 / v5e / v5p / v6e) compile with libtpu's compile-only topologies; `h100`, `8xh100`,
`a100`, ... with the CUDA plugin's deviceless compile (Triton to PTX/cubin; target descriptions in
d2f_jax/aot/targets). A real target never falls back to the CPU: without its compiler the check prints one
line naming the environment to use and exits 2. `cpu-N` (N fake CPU devices) checks the partitioning only.
Attention defaults to the Pallas kernels on a real target (inside shard_map under the mesh).

Per program it prints the compiler's per-device memory (arguments, outputs, aliased, temporaries, generated
code) against the device's HBM (90% usable) and the compile seconds. `--config.FIELD=VALUE` overrides a config
field, as for distill. Exit status: 0 every program compiled and fits; 1 a compile failed; 2 bad arguments or
the target's compiler is missing; 3 a program does not fit the device.

(This module: argument parsing, config loading with `--config.x=y` overrides, and the run loop.)
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import subprocess
import sys

from d2f_jax.aot import topology as topo
from d2f_jax.aot.programs import PROGRAMS
from d2f_jax.sharding.mesh import parse_mesh
from d2f_jax.sharding.rules import MESH_AXES

EXIT_COMPILE_ERROR, EXIT_BAD_INPUT, EXIT_DOES_NOT_FIT = 1, 2, 3
_FAMILY_PRESET = {"llada": "llada-8b", "dream": "dream-7b"}


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m d2f_jax.aot", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--target", "--topology", dest="target", required=True,
                 help="v5e-8, v5p-8, v5p-64, v6e-8, v4-8, v5p:2x4x4, h100, 8xh100, a100, 8xa100, or cpu-N "
                      "(N fake CPU devices: the partitioning is checked, the sizes are the CPU compiler's)")
  p.add_argument("--config", action="append", required=True,
                 help="config 'path.py[:arg]' (repeat to check several); --config.FIELD=VALUE overrides apply to all")
  p.add_argument("--program", action="append", choices=PROGRAMS,
                 help="what to compile (repeatable; default train): the config's train step, or the whole "
                      "jitted D2F / AR decode loop of its model")
  p.add_argument("--attention", choices=("auto", "xla", "pallas"),
                 help="attention implementation (default: pallas on a real target, config.model's on cpu-N)")
  p.add_argument("--mesh", help="train mesh override: data=..,fsdp=..,tensor=.. (one may be -1)")
  p.add_argument("--decode_mesh", help="decode mesh (default: heads over the largest power of two dividing them, "
                                       "rows over the rest)")
  p.add_argument("--batch", default="1,32", help="decode batch sizes, comma-separated (default 1,32)")
  p.add_argument("--prompt_len", type=int, default=512, help="decode prompt width (default 512)")
  p.add_argument("--new_tokens", type=int, default=256, help="decode new tokens (default 256)")
  p.add_argument("--block_size", type=int, default=32, help="decode block size (default 32)")
  p.add_argument("--quick", action="store_true",
                 help="the config's family at tiny size (tiny-llada / tiny-dream), train seq_len 64 and one row per "
                      "batch shard, decode prompt 64 + 32 tokens: checks the plumbing in seconds")
  p.add_argument("--no_compile", action="store_true", help="lower only (fits is then judged on the arguments)")
  p.add_argument("--top", type=int, default=0, help="list this many of the largest per-device arrays")
  p.add_argument("--json", help="write the reports here")
  return p


def split_overrides(argv: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
  """(the other arguments, [(field, value)] of --config.FIELD=VALUE / --config.FIELD VALUE)."""
  rest, overrides, i = [], [], 0
  while i < len(argv):
    arg = argv[i]
    if arg.startswith("--config."):
      field, eq, value = arg[len("--config."):].partition("=")
      if not eq:
        if i + 1 >= len(argv):
          raise ValueError(f"{arg} needs a value")
        value, i = argv[i + 1], i + 1
      overrides.append((field, value))
    else:
      rest.append(arg)
    i += 1
  return rest, overrides


def _typed(value: str, current):
  try:
    parsed = ast.literal_eval(value)
  except (ValueError, SyntaxError):
    parsed = value
  if isinstance(current, bool) and isinstance(parsed, str) and parsed.lower() in ("true", "false"):
    return parsed.lower() == "true"
  if isinstance(current, float) and isinstance(parsed, int) and not isinstance(parsed, bool):
    return float(parsed)
  return parsed


def load_config(spec: str, overrides, args):
  """(config with overrides applied, model name for the report)."""
  from d2f_jax import config_files
  from d2f_jax.train.config import load_config_file, validate
  config = load_config_file(config_files.resolve(spec))
  with config.unlocked():
    for field, value in overrides:
      current = config
      for part in field.split("."):
        if not hasattr(current, "keys") or part not in current:
          raise ValueError(f"--config.{field}={value}: the config has no field {field!r}")
        current = current[part]
      try:
        config.update_from_flattened_dict({field: _typed(value, current)})
      except (KeyError, AttributeError, TypeError) as e:
        raise ValueError(f"--config.{field}={value}: {e}") from None
    if args.mesh:
      config.mesh.update({**dict.fromkeys(MESH_AXES, 1), **parse_mesh(args.mesh)})
    if not config.model.preset and not config.model.path:
      base = os.path.basename(spec.partition(":")[0]).lower()
      family = next((f for f in _FAMILY_PRESET if f in base), None)
      if family is None:
        raise ValueError(f"{spec}: no model.preset or model.path, and the file name names no family; "
                         "pass --config.model.preset=NAME")
      config.model.preset = _FAMILY_PRESET[family]
    config.model.synthetic = False  # nothing is read: no weights, no data
    for field in ("path", "tokenizer"):
      if field in config.data and config.data[field] is None:
        config.data[field] = "<not read by the compile check>"
    if args.quick:
      family = "dream" if "dream" in (config.model.preset or "") else "llada"
      config.model.preset, config.model.path, config.model.dtype = f"tiny-{family}", None, "float32"
      config.data.seq_len = 64
      config.loss_chunk = 0 if 64 % max(config.loss_chunk, 1) else config.loss_chunk
      config.block_size = min(config.block_size, 16)
  validate(config)
  return config, config.model.preset or config.model.path


def _quick_batch(config, devices: list) -> None:
  """--quick: one row per batch shard and micro batch."""
  from d2f_jax import sharding
  mesh = sharding.make_mesh(config.mesh, devices)
  entry = sharding.batch_sharding(mesh, sharding.normalize_rules(config.logical_axis_rules)).spec[0]
  axes = [a for a in (entry if isinstance(entry, tuple) else (entry,)) if a]
  with config.unlocked():
    config.batch_size = math.prod(mesh.shape[a] for a in axes) * config.micro_batches


def _cpu_child(argv: list[str], n: int) -> int:
  env = dict(os.environ, XLA_FLAGS=topo.cpu_device_flag(n), JAX_PLATFORMS="cpu", D2F_AOT_CHILD="1")
  return subprocess.call([sys.executable, "-m", "d2f_jax.aot", *argv], env=env)


def main(argv: list[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = build_parser()
  try:
    rest, overrides = split_overrides(argv)
  except ValueError as e:
    parser.error(str(e))
  args = parser.parse_args(rest)
  programs = args.program or ["train"]
  try:
    target = topo.parse_target(args.target)
    batches = [int(b) for b in args.batch.split(",") if b.strip()]
    decode_mesh = parse_mesh(args.decode_mesh, "--decode_mesh") if args.decode_mesh else None
    configs = [(spec, *load_config(spec, overrides, args)) for spec in args.config]
  except (ValueError, FileNotFoundError, KeyError) as e:
    parser.error(str(e))

  if "train" in programs:
    for spec, config, _ in configs:
      sizes = [int(config.mesh.get(a, 1)) for a in MESH_AXES]
      known = math.prod(s for s in sizes if s != -1)
      if (-1 in sizes and target.chips % known) or (-1 not in sizes and known != target.chips):
        parser.error(f"{spec}: mesh {dict(config.mesh)} does not fit the {target.chips} devices of {target.name}; "
                     "adjust --mesh or --config.mesh.*")

  if target.platform == "cpu":
    os.environ["XLA_FLAGS"] = topo.cpu_device_flag(target.chips)  # effective only if no backend started yet
  topo.configure_jax(target.platform)
  try:
    devices = topo.devices(target)
  except topo.CompilerMissing as e:
    print(f"error: {e}", file=sys.stderr)
    return EXIT_BAD_INPUT
  except RuntimeError as e:
    if target.platform == "cpu" and not os.environ.get("D2F_AOT_CHILD"):
      return _cpu_child(argv, target.chips)  # this process's JAX already runs with another device count
    print(f"error: {e}", file=sys.stderr)
    return EXIT_BAD_INPUT

  from d2f_jax.aot import check, memory, programs as progs
  attention = args.attention or ("pallas" if target.platform != "cpu" else None)
  reports, status = [], 0
  for spec, config, model in configs:
    if args.quick and "train" in programs:
      _quick_batch(config, devices)
    jobs = []
    for name in programs:
      if name == "train":
        jobs.append((name, {}))
      else:
        jobs += [(name, {"batch": b}) for b in batches]
    for name, extra in jobs:
      label = f"{spec} {name}{' batch ' + str(extra['batch']) if extra else ''}"
      print(f"== {label} on {target.name}")
      try:
        if name == "train":
          program = progs.train_program(config, devices, attention=attention)
        else:
          quick = dict(prompt_len=64, new_tokens=32, block_size=16) if args.quick else {}
          program = progs.decode_program(
              config, devices, method=name.removesuffix("_decode"), batch=extra["batch"],
              prompt_len=quick.get("prompt_len", args.prompt_len), new_tokens=quick.get("new_tokens", args.new_tokens),
              block_size=quick.get("block_size", args.block_size), attention=attention, mesh_shape=decode_mesh)
        mc = progs.model_config_of(config, attention)
        report = check.compile_program(program, target, devices, model=model, dtype=mc.dtype,
                                       attention_impl=mc.attention_impl, compile=not args.no_compile, top=args.top)
      except Exception as e:  # noqa: BLE001 - a failed compile is the finding: report it and go on
        message = " ".join(str(e).split())[:2000]
        print(f"  FAILED: {type(e).__name__}: {message}")
        reports.append({"config": spec, "program": name, **extra, "target": target.name,
                        "error": f"{type(e).__name__}: {message}"})
        status = EXIT_COMPILE_ERROR
        continue
      report["config"] = spec
      print(memory.format_report(report))
      if not report["fits"] and status == 0:
        status = EXIT_DOES_NOT_FIT
      reports.append(report)

  if args.json:
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
      json.dump({"target": target.name, "usable_fraction": topo.USABLE_FRACTION, "results": reports}, f, indent=2,
                default=str)
      f.write("\n")
    print(f"wrote {args.json}")
  return status
