r"""Measure decode forwards on a real GPU / TPU, beside the projection for the same target (`bench cost`).

  python -m d2f_jax.bench device                       # LLaDA-8B shape, random weights, within ~5 minutes
  python -m d2f_jax.bench device --model dream-7b --widths 1,2,3 --batch 1

What it measures: ms per forward of the 8B-shaped model (random bf16 weights, initialised on the device; the
Pallas kernels) for the programs a decode runs (decode/forward_probes.py): the D2F step at each window width,
the AR step and both prefills, at each batch, on the decode mesh over this host's devices; each forward
is compiled once, then timed over `--repeats` calls. Beside each: the projected ms of the same program on
this target (the compiled cost from `--cost_cache` when `bench cost` has compiled it, and the formula),
and measured / projected. Then, when the main job's models are in `--workdir`, end-to-end D2F vs AR
tokens/s on held-out problems (bench/device_e2e.py). Programs are taken in order of importance and none is
started after `--budget_s`, so the run fits a short loan of a device.

It refuses to run on a CPU (one `error:` line, exit 2): the numbers would say nothing about an accelerator.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

from d2f_jax.usage import ArgumentParser
from d2f_jax import datasheets
from d2f_jax.bench.cost import model as cm
from d2f_jax.bench.cost import SHEETS
from d2f_jax.reporting import format_table, write_json, write_report

EXIT_BAD_INPUT = 2


def accelerator() -> str | None:
  """The device kind of this process's default backend when it is a GPU or TPU, else None."""
  if jax.default_backend() not in ("gpu", "tpu", "cuda", "rocm"):
    return None
  return str(jax.devices()[0].device_kind)


def target_for(device_kind: str, count: int) -> tuple[str | None, str]:
  """(the `bench cost` target whose compiled costs apply, data sheet name) of `count` devices of a kind.
  An H200 runs the H100's programs (same sm_90 compiler target) at its own bandwidth."""
  kind = device_kind.lower()
  sheet = datasheets.for_device_kind(device_kind)
  name = sheet.name if sheet else None
  for match, target in (("h200", "h100"), ("h100", "h100"), ("a100", "a100"), ("v5 lite", f"v5e-{count}"),
                        ("v5e", f"v5e-{count}"), ("v6", f"v6e-{count}"), ("v5", f"v5p-{2 * count}"),
                        ("v4", f"v4-{2 * count}")):
    if match in kind:
      if target in ("h100", "a100") and count > 1:
        target = f"{count}x{target}"
      return target, name or SHEETS.get(target.split("-")[0].split("x")[-1], "")
  return None, name or ""


def random_model(config, mesh):
  """A model handle with random weights (normal x 0.02, the config's dtype) made on the devices, already in
  the decode shardings: the 8B weights never pass through the host."""
  from d2f_jax.api import Model
  from d2f_jax.decode.mesh import as_decode_mesh
  from d2f_jax.models import abstract_model
  graphdef, state = nnx.split(abstract_model(config))
  pure = nnx.to_pure_dict(state)
  shardings = as_decode_mesh(mesh).param_shardings(state)
  leaves, tree = jax.tree.flatten(pure)

  def init(key):
    keys = jax.random.split(key, len(leaves))
    return tree.unflatten([(0.02 * jax.random.normal(k, x.shape, jnp.float32)).astype(x.dtype)
                           for k, x in zip(keys, leaves)])
  values = jax.jit(init, out_shardings=shardings)(jax.random.key(0))
  params = jax.tree.map(lambda x: x, state)
  nnx.replace_by_pure_dict(params, values)
  return Model(config=config, graphdef=graphdef, state=params)


def shapes(args) -> list:
  """Every StepShape to time, most important first: batch by batch, widths, AR step, prefills."""
  from d2f_jax.decode.forward_probes import StepShape
  new, block, length = (32, 8, 64) if args.tiny else (args.new_tokens, args.block_size, args.cache_len)
  out = []
  for batch in cm_ints(args.batch):
    common = dict(batch=batch, prompt=length - new, new_tokens=new, block_size=block)
    out += [StepShape("d2f_step", width=w, **common) for w in cm_ints(args.widths)]
    out += [StepShape(kind, **common) for kind in ("ar_step", "d2f_prefill", "ar_prefill")]
  return out


def cm_ints(text: str) -> list[int]:
  values = [int(v) for v in text.split(",") if v.strip()]
  if not values or min(values) <= 0:
    raise ValueError(f"expected comma-separated positive ints, got {text!r}")
  return values


def projected(target, sheet, model: str, config, shape, mesh_shape: dict, cost_dirs: list[str]) -> dict:
  """Projected ms of `shape` on this target: compiled (when a cost cache holds it) and formula."""
  import dataclasses
  from d2f_jax.bench.cost import cache_key, implausible_group, load_json
  # Any jax version's compile will do (the device may run another), but only this cost version's.
  key_tail = cache_key(str(target), model, dataclasses.asdict(shape)).split("|", 1)[1]
  entry, group = None, []
  for folder in cost_dirs:
    cache = load_json(os.path.join(folder, f"{target}.json")) if target else {}
    found = next((v for k, v in cache.items() if k.split("|", 1)[1] == key_tail), None)
    if found is not None:
      entry = found
      group = [v for k, v in cache.items() if k.split("|")[1] == key_tail.split("|")[0]
               and v["model"] == model and v["cache_len"] == found["cache_len"]]
  out = {"formula": cm.milliseconds(cm.formula_cost(config, shape, mesh_shape), sheet)}
  if entry is not None:
    accounted = cm.accounted_cost(entry["compiled"], config, shape, entry["mesh"])
    if implausible_group(group):  # bench cost's rule: that compiler's bytes are not traffic, its FLOPs are kept
      accounted = cm.with_formula_bytes(accounted, cm.formula_cost(config, shape, entry["mesh"]))
    out["compiled"] = cm.milliseconds(accounted, sheet)
  return out


def build_parser() -> argparse.ArgumentParser:
  p = ArgumentParser("python -m d2f_jax.bench device", __doc__)
  p.add_argument("--model", default="llada-8b", help="model preset (random weights)")
  p.add_argument("--widths", default="1,2,3,4,5", help="D2F window widths in blocks")
  p.add_argument("--batch", default="1,32", help="batch sizes measured, comma-separated")
  p.add_argument("--cache_len", type=int, default=1024, help="KV cache length = prompt + new tokens")
  p.add_argument("--new_tokens", type=int, default=256, help="response tokens per row")
  p.add_argument("--block_size", type=int, default=32, help="D2F block size")
  p.add_argument("--repeats", type=int, default=10, help="timed calls per program (after one untimed compile)")
  p.add_argument("--budget_s", type=float, default=240.0, help="start no program after this many seconds")
  p.add_argument("--tiny", action="store_true", help="tiny shapes (cache 64, 32 new tokens, block 8): tests")
  p.add_argument("--cost_cache", default="results/bench_cost_cache",
                 help="bench cost's compiled costs (the packaged d2f_jax/bench/compiled_costs are read too)")
  p.add_argument("--workdir", default="workdir/tiny_e2e", help="the main job's models, for end-to-end speed")
  p.add_argument("--out", default="results/bench_device.json", help="where the report is written")
  return p


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  kind = accelerator()
  if kind is None:
    print(f"error: bench device measures a GPU or TPU, and this process's JAX backend is "
          f"{jax.default_backend()!r}; run it on the accelerator host (for a projection here: bench cost)",
          file=sys.stderr)
    return EXIT_BAD_INPUT
  from d2f_jax.aot.programs import decode_mesh_shape
  from d2f_jax.decode.forward_probes import forward_probe, time_ms
  from d2f_jax.models import preset
  from d2f_jax import sharding
  start = time.perf_counter()
  try:
    config = preset(args.model, dtype="bfloat16", param_dtype="bfloat16",
                    attention_impl="xla" if jax.default_backend() == "cpu" else "pallas")
    todo = shapes(args)
  except (KeyError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return EXIT_BAD_INPUT
  devices = jax.devices()
  target, sheet_name = target_for(kind, len(devices))
  sheet = datasheets.by_name(sheet_name) if sheet_name else None
  mesh_shape = decode_mesh_shape(config, len(devices))
  mesh = sharding.make_mesh(mesh_shape, devices)
  model = random_model(config, mesh)
  packaged = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compiled_costs")
  rows, skipped = [], []
  for shape in todo:
    if time.perf_counter() - start > args.budget_s:
      skipped.append(f"{shape.kind} w{shape.width} b{shape.batch}")
      continue
    ms = time_ms(forward_probe(model, shape, mesh=mesh), args.repeats)
    row = {"program": shape.kind, "width": shape.width if shape.kind == "d2f_step" else "", "batch": shape.batch,
           "measured ms": cm.fmt(ms)}
    if sheet is not None:
      proj = projected(target, sheet, args.model, config, shape, mesh_shape, [packaged, args.cost_cache])
      for source in ("compiled", "formula"):
        value = proj.get(source)
        row[f"projected ms ({source})"] = cm.fmt(value) if value else "-"
        row[f"measured / {source}"] = f"{ms / value:.2f}" if value else "-"
    rows.append(row)
    print(f"  {shape.kind} width {shape.width} batch {shape.batch}: {ms:.3f} ms", flush=True)
  from d2f_jax.bench import device_e2e
  e2e = device_e2e.measure(args.workdir) if time.perf_counter() - start < args.budget_s + 60 else None
  print(f"{args.model} (random weights, bf16) on {len(devices)} x {kind}, mesh {mesh_shape}; projections for "
        f"target {target} priced on {sheet_name or 'no data sheet'}; {time.perf_counter() - start:.0f}s")
  if skipped:
    print(f"not measured (past --budget_s {args.budget_s:g}): {', '.join(skipped)}")
  if e2e:
    print(format_table(e2e))
  extra = dict(device=kind, target=target, datasheet=sheet_name, mesh=mesh_shape, skipped=skipped, e2e=e2e or [],
               args=vars(args))
  if rows:
    write_report(args.out, "device", rows, **extra)
  else:  # nothing measured within the budget: the report says what was skipped
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    write_json(args.out, {"benchmark": "device", "rows": [], **extra})
  return 0
