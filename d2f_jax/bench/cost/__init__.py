r"""Projected decode speed of LLaDA-8B / Dream-7B on named targets, from the compiled programs' own costs.

  python -m d2f_jax.bench cost --target h100 --target v5p-8 --results workdir/tiny_e2e/results.json --json out.json
  python -m d2f_jax.bench cost --target v5e-8 --model llada-8b --cache_len 1024 --widths 1,2,3
  python -m d2f_jax.bench cost --target cpu --tiny --datasheet "H100 SXM" ...   # seconds, for tests

For each target, model and cache length it compiles, with the target's real compiler (libtpu, the CUDA
plugin; abstract bf16 weights, Pallas attention, the target's decode mesh as `aot` picks it), the forwards a
decode runs (decode/forward_probes.py): the D2F step at each window width, the AR step, vanilla's full
forward and both prefills, at the `--batch` sizes. FLOPs and bytes per device come from each executable's
cost analysis (bench/cost/compiled.py says how loops, opaque Pallas kernels and NVIDIA's missing analysis are
handled); ms per forward = max(FLOPs / peak, bytes / bandwidth) with the data sheets' peaks. With the tokens
per forward and window widths of a results.json it prints projected tokens/s of every method at each batch
of `--project`, D2F / AR, and the batch above which AR is faster. Every number is a projection; each cell
reads 'compiled / formula' (the hand-written roofline of e2e/projection.py, the cross-check).

A target whose compiler is not in this environment is compiled in a child process by the venv of
`--accel_venvs` (default $D2F_ACCEL_VENVS: <root>/tpu, <root>/cuda, as .ci/accel_venvs.sh makes them).
Compiled costs are cached in `--cache` (one entry per program), so a re-run or another table recompiles
nothing. Exit 2: bad arguments or a missing compiler.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from d2f_jax.usage import ArgumentParser
from d2f_jax import datasheets
from d2f_jax.aot import topology as topo
from d2f_jax.bench.cost import model as cm, report as cost_report
from d2f_jax.reporting import format_table, write_json

MODELS = ("llada-8b", "dream-7b")
SHEETS = {"h100": "H100 SXM", "a100": "A100 80GB", "v5e": "TPU v5e", "v5p": "TPU v5p", "v6e": "TPU v6e", "v4": "TPU v4"}
TINY = dict(models=("tiny-llada", "tiny-dream"), cache_len=(64,), new_tokens=32, block_size=8)


def build_parser() -> argparse.ArgumentParser:
  p = ArgumentParser("python -m d2f_jax.bench cost", __doc__)
  p.add_argument("--target", action="append", required=True, help="h100, a100, v5e-8, v5p-8, v6e-8, ... or cpu")
  p.add_argument("--model", action="append", help=f"model preset (repeatable; default {', '.join(MODELS)})")
  p.add_argument("--results", default="workdir/tiny_e2e/results.json",
                 help="results.json whose tokens per forward and window widths are projected")
  p.add_argument("--cache_len", default="512,1024", help="KV cache lengths = prompt + new tokens (comma list)")
  p.add_argument("--new_tokens", type=int, default=256, help="response tokens per row (default 256)")
  p.add_argument("--block_size", type=int, default=32, help="D2F block size")
  p.add_argument("--widths", help="D2F window widths in blocks (default: the decoder's width set)")
  p.add_argument("--batch", default="1,32", help="batches compiled (>= 2; other batches are affine between)")
  p.add_argument("--project", default="1,8,32,128", help="batches of the tokens/s table")
  p.add_argument("--frontier", action="store_true",
                 help="per batch, the fastest D2F mode of --results within one standard error of exact D2F")
  p.add_argument("--programs", default="d2f_step,ar_step,full_step,d2f_prefill,ar_prefill",
                 help="forwards compiled, comma-separated")
  p.add_argument("--tiny", action="store_true", help="tiny-llada / tiny-dream, cache 64, 32 new tokens, block 8")
  p.add_argument("--datasheet", help="price every target on this data sheet (default: the target's own)")
  p.add_argument("--cache", default="results/bench_cost_cache",
                 help="directory of compiled costs, one JSON file per target ('' = no cache)")
  p.add_argument("--accel_venvs",
                 default=os.environ.get("D2F_ACCEL_VENVS", os.path.expanduser("~/accel")),
                 help="root of the compiler venvs .ci/accel_venvs.sh makes ($D2F_ACCEL_VENVS)")
  p.add_argument("--compile_only", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--json", default="results/bench_cost.json", help="where the report is written")
  return p


def _ints(text: str, flag: str) -> list[int]:
  try:
    values = [int(v) for v in text.split(",") if v.strip()]
  except ValueError:
    raise ValueError(f"{flag} {text!r}: expected comma-separated ints") from None
  if not values or min(values) <= 0:
    raise ValueError(f"{flag} {text!r}: expected positive ints")
  return values


def plan(args) -> list[tuple[str, int, dict]]:
  """(model, cache length, StepShape fields) of every program to compile."""
  from d2f_jax.decode.widths import window_widths_for
  from d2f_jax.decode.forward_probes import KINDS, StepShape
  models = args.model or (TINY["models"] if args.tiny else MODELS)
  lengths = list(TINY["cache_len"]) if args.tiny and args.cache_len == "512,1024" else _ints(args.cache_len, "--cache_len")
  new, block = (TINY["new_tokens"], TINY["block_size"]) if args.tiny else (args.new_tokens, args.block_size)
  blocks = new // block
  widths = _ints(args.widths, "--widths") if args.widths else list(window_widths_for(None, blocks))
  kinds = [k.strip() for k in args.programs.split(",") if k.strip()]
  bad = [k for k in kinds if k not in KINDS]
  if bad:
    raise ValueError(f"--programs: unknown {bad}; expected some of {KINDS}")
  if len(_ints(args.batch, "--batch")) < 2:
    raise ValueError(f"--batch {args.batch!r}: compile at least two batches (costs are fitted between them)")
  out = []
  for model in models:
    for length in lengths:
      if length <= new:
        raise ValueError(f"--cache_len {length} must exceed --new_tokens {new} (it holds the prompt too)")
      for batch in _ints(args.batch, "--batch"):
        for kind in kinds:
          for width in (widths if kind == "d2f_step" else [1]):
            fields = dict(kind=kind, batch=batch, prompt=length - new, new_tokens=new, block_size=block, width=width)
            StepShape(**fields)  # validates (a width over the response's blocks is refused here)
            out.append((model, length, fields))
  return out


def cache_key(target: str, model: str, fields: dict) -> str:
  """One program's key: the jax version and the cost version (cost_compile.COST_VERSION) make entries of
  other programs or accounting stale, never reused."""
  import jax
  from d2f_jax.bench.cost.compiled import COST_VERSION
  return "|".join([jax.__version__, f"v{COST_VERSION}", target, model] + [f"{k}={v}" for k, v in sorted(fields.items())])


def load_json(path: str) -> dict:
  """A JSON file, or {} when there is none (a cache not yet written)."""
  if path and os.path.exists(path):
    with open(path) as f:
      return json.load(f)
  return {}


def cache_file(cache_dir: str, target) -> str:
  return os.path.join(cache_dir, f"{target.name}.json") if cache_dir else ""


def compile_target(target, programs, cache_path: str, log=print) -> dict:
  """Compile (or take from the cache file) every program for one target; returns {key: entry}."""
  from d2f_jax.aot.programs import decode_mesh_shape
  from d2f_jax.bench.cost import compiled as cost_compile
  from d2f_jax.models import preset
  from d2f_jax import sharding
  topo.configure_jax(target.platform)
  devices = topo.devices(target)
  cache, out = load_json(cache_path), {}
  current = cache_key(target.name, "", {}).split("|")[:2]  # jax version, cost version
  stale = [k for k in cache if k.split("|")[:2] != current]
  if stale:
    log(f"{cache_path}: {len(stale)} cached costs from another jax or cost version are stale; dropped")
    cache = {k: v for k, v in cache.items() if k not in stale}
  for model, length, fields in programs:
    key = cache_key(target.name, model, fields)
    if key not in cache:
      from d2f_jax.decode.forward_probes import StepShape
      config = preset(model, dtype="bfloat16", param_dtype="bfloat16",
                      attention_impl="xla" if target.platform == "cpu" else "pallas")
      mesh_shape = decode_mesh_shape(config, len(devices))
      log(f"== {model} on {target.name} (mesh {mesh_shape}), cache {length}")
      compiled = cost_compile.compiled_forward(config, StepShape(**fields), sharding.make_mesh(mesh_shape, devices), log)
      cache[key] = {"model": model, "cache_len": length, "shape": fields, "mesh": mesh_shape,
                    "device_kind": str(devices[0].device_kind), "compiled": compiled}
      if cache_path:
        os.makedirs(os.path.dirname(os.path.abspath(cache_path)), exist_ok=True)
        write_json(cache_path, cache)
    out[key] = cache[key]
  return out


def _child(target, argv: list[str], venvs: str) -> int:
  """This command line for one target, compile only, in the venv of its compiler."""
  rest = [a for i, a in enumerate(argv) if a != "--target" and (i == 0 or argv[i - 1] != "--target")]
  return topo.run_with_compiler(target, venvs, ["d2f_jax.bench", "cost", *rest, "--target", target.name,
                                                "--compile_only"])


def tables(target, entries: dict, results: dict, args, log=print) -> list[dict]:
  """Accounted and formula costs of every entry, then the two tables per (model, cache length)."""
  from d2f_jax.decode.forward_probes import StepShape
  from d2f_jax.models import preset
  sheet = datasheets.by_name(args.datasheet or SHEETS.get(target.kind, ""))
  rows = [r for r in results.get("rows", []) if r.get("tokens_per_forward")]
  groups = {}
  for entry in entries.values():
    config = preset(entry["model"], dtype="bfloat16", param_dtype="bfloat16")
    shape = StepShape(**entry["shape"])
    entry["accounted"] = cm.accounted_cost(entry["compiled"], config, shape, entry["mesh"])
    entry["formula"] = cm.formula_cost(config, shape, entry["mesh"])
    groups.setdefault((entry["model"], entry["cache_len"]), []).append(entry)
  out = []
  for (model, length), group in groups.items():
    new = group[0]["shape"]["new_tokens"]
    title = (f"PROJECTION (not a measurement): {model} bf16 on {target.name} ({sheet.name}: {sheet.bf16_tflops:g} "
             f"TFLOP/s, {sheet.hbm_gbps:g} GB/s per chip; mesh {group[0]['mesh']}), cache {length} = prompt "
             f"{length - new} + {new} new tokens, block {group[0]['shape']['block_size']}")
    refused = _refuse_implausible_bytes(group)
    if refused:
      title += (f"\nThe compiler's byte counts are not HBM traffic here ({refused}): the 'compiled' column "
                "takes its FLOPs and the formula's bytes")
    programs = cost_report.program_rows(group, sheet)
    ms = cost_report.ms_tables(group, sheet)
    fitted = len(ms["compiled"]) >= 2  # tokens/s needs costs at two batches (affine in the rows)
    block = group[0]["shape"]["block_size"]
    methods = (cost_report.method_rows(rows, ms, _ints(args.project, "--project"), new, block)
               if rows and fitted else [])
    log(f"\n{title}\nper forward (compiler's count; attention by formula where the kernel is opaque):")
    log(format_table(programs))
    if methods:
      log(f"tokens/s and D2F / AR, each cell 'compiled / formula', with {results.get('source', 'the results')}'s "
          "tokens per forward and window widths:")
      log(format_table(methods))
    frontier = (cost_report.frontier_rows(rows, ms, _ints(args.project, "--project"), new, block, target=target.name,
                                          model=model, cache_len=length) if args.frontier and fitted else [])
    if frontier:
      log("frontier (the fastest mode within one standard error of exact D2F, tokens/s compiled):")
      log(format_table(frontier))
    out.append({"target": target.name, "model": model, "cache_len": length, "datasheet": sheet.name,
                "title": title, "programs": programs, "methods": methods, "frontier": frontier, "entries": group})
  return out


def implausible_group(group: list[dict]) -> str:
  """Why the compiled bytes of one (target, model, cache length) group of cache entries are not HBM traffic,
  or '': any program's count failing model.implausible_bytes, or one program accounting fewer bytes at a
  larger batch (more rows never move less), condemns the group's (one compiler's byte model, trusted whole or
  not at all). libtpu passes the first test on some tables and fails the second (v5p-8 Dream-7B, cache 512:
  AR step 5.23 GB at batch 1, 5.15 GB at batch 32)."""
  from d2f_jax.decode.forward_probes import StepShape
  from d2f_jax.models import preset
  reasons, by_program = [], {}
  for e in group:
    config = preset(e["model"], dtype="bfloat16", param_dtype="bfloat16")
    accounted = cm.accounted_cost(e["compiled"], config, StepShape(**e["shape"]), e["mesh"])
    name = f"{e['shape']['kind']} width {e['shape']['width']}"
    by_program.setdefault(name, {})[e["shape"]["batch"]] = accounted["bytes"]
    why = cm.implausible_bytes(e["compiled"], accounted, config, e["mesh"])
    if why:
      reasons.append(f"{name} batch {e['shape']['batch']}: {why}")
  for name, by_batch in by_program.items():
    if cm.falls_with_rows(by_batch):
      lo, hi = min(by_batch), max(by_batch)
      reasons.append(f"{name}: {by_batch[lo] / 1e9:.3g} GB accounted at batch {lo}, fewer ({by_batch[hi] / 1e9:.3g}) "
                     f"at batch {hi}")
  if not reasons:
    return ""
  return f"{len(reasons)} failed check{'s' * (len(reasons) > 1)} over {len(group)} programs, e.g. {reasons[0]}"


def _refuse_implausible_bytes(group: list[dict]) -> str:
  """Every entry of a group whose compiled bytes are implausible takes the formula's bytes; returns why, or ''."""
  refused = implausible_group(group)
  if refused:
    for e in group:
      e["accounted"] = cm.with_formula_bytes(e["accounted"], e["formula"])
  return refused


def main(argv: list[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = build_parser()
  args = parser.parse_args(argv)
  try:
    targets = [topo.parse_target(t) for t in args.target]
    programs = plan(args)
    results = {}
    if not args.compile_only:
      if not os.path.exists(args.results):
        raise ValueError(f"--results {args.results}: no such file (run the main job, or pass a results.json)")
      results = {**load_json(args.results), "source": args.results}
    if args.datasheet:
      datasheets.by_name(args.datasheet)
  except (ValueError, KeyError) as e:
    parser.error(str(e))
  report = []
  for target in targets:
    try:
      if not topo.has_compiler(target):
        if _child(target, argv, args.accel_venvs):
          print(f"error: compiling for {target.name} failed in the child process", file=sys.stderr)
          return 1
        entries = {k: v for k, v in load_json(cache_file(args.cache, target)).items()
                   if k in {cache_key(target.name, m, f) for m, _, f in programs}}
      else:
        entries = compile_target(target, programs, cache_file(args.cache, target))
    except topo.CompilerMissing as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
    if not args.compile_only:
      report += tables(target, entries, results, args)
  if not args.compile_only and args.json:
    write_json(args.json, {"benchmark": "cost", "note": "projections, not measurements", "args": vars(args),
                           "tables": report, "frontier": [row for table in report for row in table["frontier"]]})
    print(f"wrote {args.json}")
  return 0
