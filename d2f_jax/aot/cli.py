r"""The compile tier: compile the product's programs with the real TPU or NVIDIA compiler, without the hardware.

  python -m d2f_jax.aot --target v5p-64 --config configs/llada_8b.py:tpu_v5p_64 --program train
  python -m d2f_jax.aot --target 8xh100 --config configs/dream_7b.py:gpu_8xh100 --program train --json out.json
  python -m d2f_jax.aot --target v5e-8 --config configs/llada_8b.py --program d2f_decode --program ar_decode
  python -m d2f_jax.aot --target h100 --config configs/dream_7b.py --program d2f_decode --batch 1,32
  python -m d2f_jax.aot --target cpu-8 --config configs/llada_8b.py:tpu_v5p_64 --quick --mesh data=2,fsdp=2,tensor=2

Programs: `train` is the config's train step (its objective; teacher + LoRA student for distill) built by the
Trainer's own `train.step.spec_from_config` and `compiled_train_step`; `d2f_decode` / `ar_decode` are the whole
jitted decode loop `generate` runs (`decode.runner.decode_program`; default prompt 512, 256 new tokens,
block 32, batch 1 and 32); `llada2_decode` the same loop of LLaDA2's released sampler; `serve` / `llada2_serve`
the serving engine's advance and insert programs (d2f, or the released sampler's). Inputs are abstract
(`jax.ShapeDtypeStruct` + sharding): no weight is allocated.

Targets: TPU slices (v4 / v5e / v5p / v6e) compile with libtpu's compile-only topologies; `h100`, `8xh100`,
`a100`, ... with the CUDA plugin's deviceless compile (Triton to PTX/cubin; target descriptions in
d2f_jax/aot/targets). A real target never falls back to the CPU: without its compiler the check prints one
line naming the environment to use and exits 2. `cpu-N` (N fake CPU devices) checks the partitioning only.
Attention defaults to the Pallas kernels on a real target (inside shard_map under the mesh).

Per program it prints the compiler's per-device memory (arguments, outputs, aliased, temporaries, generated
code) against the device's HBM (90% usable) and the compile seconds. `--config.FIELD=VALUE` overrides a config
field, as for distill (ml_collections config flags); one `--config` per run. Exit status: 0 every program
compiled and fits; 1 a compile failed; 2 bad arguments or the target's compiler is missing (one `error:`
line); 3 a program does not fit the device.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

from absl import flags

from d2f_jax import config_files, usage
from d2f_jax.aot import topology as topo
from d2f_jax.aot.programs import PROGRAMS
from d2f_jax.sharding.mesh import parse_mesh
from d2f_jax.sharding.rules import MESH_AXES

EXIT_COMPILE_ERROR, EXIT_BAD_INPUT, EXIT_DOES_NOT_FIT = 1, 2, 3
# A config file's name -> the preset it distils (first match: the LLaDA2 sizes before the LLaDA family).
_FAMILY_PRESET = {"llada2_mini": "llada2-mini", "llada2_flash": "llada2-flash", "llada": "llada-8b", "dream": "dream-7b"}


def define_flags(flag_values, argv: list[str]) -> None:
  """This CLI's flags on `flag_values` (a fresh FlagValues per call, so main() can run more than once in a
  process); `argv` is the command line the `--config.FIELD=VALUE` overrides are read from."""
  f = dict(flag_values=flag_values)
  flags.DEFINE_string("target", None, "v5e-8, v5p-8, v5p-64, v6e-8, v4-8, v5p:2x4x4, h100, 8xh100, a100, 8xa100, or "
                      "cpu-N (N fake CPU devices: the partitioning is checked, the sizes are the CPU compiler's). "
                      "Required.", **f)
  flags.DEFINE_alias("topology", "target", **f)
  config_files.DEFINE_config_file("config", None, "Config file 'path.py[:arg]' (one per run). Required.",
                                  sys_argv=argv, **f)
  flags.DEFINE_multi_enum("program", ["train"], PROGRAMS, "What to compile (repeatable): the config's train step, "
                          "the whole jitted D2F / AR / LLaDA2-sampler decode loop of its model, or the serving "
                          "engine's programs (serve, llada2_serve: advance and insert over --slots slots).", **f)
  flags.DEFINE_enum("attention", None, ["auto", "xla", "pallas"], "Attention implementation; none: pallas on a "
                    "real target, config.model's on cpu-N.", **f)
  flags.DEFINE_string("mesh", None, "Train mesh override: data=..,fsdp=..,tensor=.. (one may be -1).", **f)
  flags.DEFINE_string("decode_mesh", None, "Decode mesh; none: heads over the largest power of two dividing them, "
                      "rows over the rest.", **f)
  flags.DEFINE_list("batch", ["1", "32"], "Decode batch sizes, comma-separated.", **f)
  flags.DEFINE_integer("slots", 32, "Serving engine slots (--program serve).", **f)
  flags.DEFINE_integer("prompt_len", 512, "Decode prompt width.", **f)
  flags.DEFINE_integer("new_tokens", 256, "Decode new tokens.", **f)
  flags.DEFINE_integer("block_size", 32, "Decode block size.", **f)
  flags.DEFINE_bool("quick", False, "The config's family at tiny size (tiny-llada / tiny-dream / tiny-llada2), "
                    "train seq_len 64 and one row per batch shard, decode prompt 64 + 32 tokens: checks the plumbing "
                    "in seconds.", **f)
  flags.DEFINE_bool("block_cache", False, "llada2_decode / llada2_serve: with the cache of finished blocks "
                    "(DecodeConfig.block_cache).", **f)
  flags.DEFINE_bool("no_compile", False, "Lower only (fits is then judged on the arguments).", **f)
  flags.DEFINE_integer("top", 0, "List this many of the largest per-device arrays.", **f)
  flags.DEFINE_string("json", None, "Write the reports here.", **f)


def parse(argv: list[str]):
  """(flag values, config with the overrides and the run's adjustments, model name for the report) of a
  command line; a bad flag, config file or field raises UsageError."""
  argv = ["python -m d2f_jax.aot", *argv]
  args = flags.FlagValues()
  define_flags(args, argv)
  rest = usage.parse_absl(argv, __doc__, args)
  if len(rest) > 1:
    raise usage.UsageError(f"unexpected arguments: {' '.join(rest[1:])}")
  for name in ("target", "config"):
    if args[name].value is None:
      raise usage.UsageError(f"--{name} is required (`python -m d2f_jax.aot --help` lists the flags)")
  try:
    return args, *adjust_config(args.config, args["config"].config_filename, args)
  except ValueError as e:
    raise usage.UsageError(str(e)) from None


def adjust_config(config, spec: str, args):
  """(config made ready for an abstract compile, model name for the report)."""
  from d2f_jax.train.config import validate
  with config.unlocked():
    if args.mesh:
      config.mesh.update({**dict.fromkeys(MESH_AXES, 1), **parse_mesh(args.mesh)})
    if not config.model.preset and not config.model.path:
      base = os.path.basename(spec.partition(":")[0]).lower()
      family = next((f for f in _FAMILY_PRESET if f in base), None)
      if family == "llada" and "llada2" in base:
        raise ValueError(f"{spec}: the file name names LLaDA2 but not its size (llada2_mini or llada2_flash); "
                         "pass --config.model.preset=llada2-mini or llada2-flash")
      if family is None:
        raise ValueError(f"{spec}: no model.preset or model.path, and the file name names no family; "
                         "pass --config.model.preset=NAME")
      config.model.preset = _FAMILY_PRESET[family]
    config.model.synthetic = False  # nothing is read: no weights, no data
    for field in ("path", "tokenizer"):
      if field in config.data and config.data[field] is None:
        config.data[field] = "<not read by the compile check>"
    if args.quick:
      family = next((f for f in ("llada2", "dream") if f in (config.model.preset or "")), "llada")
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


@usage.command
def main(argv: list[str] | None = None) -> int:
  """Run the check; returns the exit status (a bad argument raises UsageError: exit 2)."""
  argv = list(sys.argv[1:] if argv is None else argv)
  args, config, model = parse(argv)
  spec, programs = args["config"].config_filename, args.program
  if args.block_cache and not any(name.startswith("llada2_") for name in programs):
    raise usage.UsageError("--block_cache is a setting of --program llada2_decode / llada2_serve")
  try:
    target = topo.parse_target(args.target)
    batches = [int(b) for b in args.batch if b.strip()]
    decode_mesh = parse_mesh(args.decode_mesh, "--decode_mesh") if args.decode_mesh else None
  except ValueError as e:
    raise usage.UsageError(str(e)) from None

  if "train" in programs:
    sizes = [int(config.mesh.get(a, 1)) for a in MESH_AXES]
    known = math.prod(s for s in sizes if s != -1)
    if (-1 in sizes and target.chips % known) or (-1 not in sizes and known != target.chips):
      raise usage.UsageError(f"{spec}: mesh {dict(config.mesh)} does not fit the {target.chips} devices of "
                             f"{target.name}; adjust --mesh or --config.mesh.*")

  if target.platform == "cpu":
    os.environ["XLA_FLAGS"] = topo.cpu_device_flag(target.chips)  # effective only if no backend started yet
  topo.configure_jax(target.platform)
  try:
    devices = topo.devices(target)
  except topo.CompilerMissing as e:
    raise usage.UsageError(str(e)) from None
  except RuntimeError as e:
    if target.platform == "cpu" and not os.environ.get("D2F_AOT_CHILD"):
      return _cpu_child(argv, target.chips)  # this process's JAX already runs with another device count
    raise usage.UsageError(str(e)) from None

  from d2f_jax.aot import check, memory, programs as progs
  attention = args.attention or ("pallas" if target.platform != "cpu" else None)
  reports, status = [], 0
  if args.quick and "train" in programs:
    _quick_batch(config, devices)
  jobs = []
  for name in programs:
    if name == "train":
      jobs.append((name, {}))
    elif name in progs.SERVE_METHODS:
      jobs.append((name, {"slots": args.slots}))
    else:
      jobs += [(name, {"batch": b}) for b in batches]
  quick = dict(prompt_len=64, new_tokens=32, block_size=16) if args.quick else {}
  sizes = dict(prompt_len=quick.get("prompt_len", args.prompt_len), new_tokens=quick.get("new_tokens", args.new_tokens),
               block_size=quick.get("block_size", args.block_size), attention=attention, mesh_shape=decode_mesh)
  for name, extra in jobs:
    label = f"{spec} {name}{''.join(f' {k} {v}' for k, v in extra.items())}"
    print(f"== {label} on {target.name}")
    llada2 = {"block_cache": True} if args.block_cache and name.startswith("llada2_") else {}
    try:
      if name == "train":
        built = [progs.train_program(config, devices, attention=attention)]
      elif name in progs.SERVE_METHODS:
        built = progs.serve_programs(config, devices, slots=extra["slots"], method=progs.SERVE_METHODS[name],
                                     **sizes, **llada2)
      else:
        built = [progs.decode_program(config, devices, method=name.removesuffix("_decode"), batch=extra["batch"],
                                      **sizes, **llada2)]
      mc = progs.model_config_of(config, attention)
      found = [check.compile_program(program, target, devices, model=model, dtype=mc.dtype,
                                     attention_impl=mc.attention_impl, compile=not args.no_compile, top=args.top)
               for program in built]
    except Exception as e:  # noqa: BLE001 - a failed compile is the finding: report it and go on
      message = " ".join(str(e).split())[:2000]
      print(f"  FAILED: {type(e).__name__}: {message}")
      reports.append({"config": spec, "program": name, **extra, "target": target.name,
                      "error": f"{type(e).__name__}: {message}"})
      status = EXIT_COMPILE_ERROR
      continue
    for report in found:
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
