r"""Which expert computation is cheaper per token count, from the compiled costs of one MoE layer.

  python -m d2f_jax.bench moe_dispatch    # h100, v5e-1, v6e-1 and this CPU; ~20 minutes on 2 cores
  python -m d2f_jax.bench moe_dispatch --target cpu --model tiny-llada2 --tokens 1,8,64   # seconds, for tests

For each target (one chip) it compiles the MoE MLP of one `--model` layer (bf16 weights, abstract) over N
tokens, both ways (models/moe.py): `dense` (every expert on every token, one combine matrix) and `ragged`
(sorted (token, expert) pairs through `lax.ragged_dot`), reads FLOPs and bytes from the executable's own cost
analysis (bench/cost/compiled.cost_of) and prices them on the target's data sheet:
ms = max(FLOPs / peak, bytes / bandwidth). The cheaper dispatch per N, as segments ("ragged up to 64
tokens, then dense"), is what `MoEConfig.dispatch="auto"` runs (models/moe.py's AUTO_DISPATCH, per
platform, from the report shipped as bench/reports/moe_dispatch.json; tests/test_moe_dispatch.py
keeps them equal). Every number is a projection of a compiled program.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from d2f_jax import datasheets
from d2f_jax.aot import topology as topo
from d2f_jax.bench.cost import SHEETS
from d2f_jax.reporting import format_table, write_json
from d2f_jax.usage import ArgumentParser

# A CPU has no data sheet here: priced at a nominal 2 TFLOP/s and 200 GB/s (a server socket's order), which
# only the ratio of the two dispatches' costs on it depends on.
CPU_SHEET = datasheets.Datasheet("CPU (nominal)", 2.0, 200.0)
DISPATCHES = ("dense", "ragged")
MARGIN = 0.05  # dense is chosen where it is priced more than 5 % cheaper than ragged


def build_parser() -> argparse.ArgumentParser:
  p = ArgumentParser("python -m d2f_jax.bench moe_dispatch", __doc__)
  p.add_argument("--target", action="append", help="h100, a100, v5e-1, v5p-8, v6e-1, cpu, repeatable; the first "
                                                   "chip of a slice is compiled (default h100, v5e-1, v6e-1, cpu)")
  p.add_argument("--model", default="llada2-mini", help="a MoE model preset (default llada2-mini)")
  p.add_argument("--tokens", default="1,2,4,8,16,32,64,128,256,512,1024,4096", help="token counts N (comma list)")
  p.add_argument("--accel_venvs", default=os.environ.get("D2F_ACCEL_VENVS", os.path.expanduser("~/accel")),
                 help="root of the compiler venvs .ci/accel_venvs.sh makes ($D2F_ACCEL_VENVS)")
  p.add_argument("--child_json", help=argparse.SUPPRESS)  # a child process writes its target's costs here
  p.add_argument("--json", default="results/moe_dispatch.json", help="where the report is written")
  return p


def layer_program(config, tokens: int, dispatch: str):
  """(function, abstract arguments) of one MoE MLP over `tokens` tokens with `dispatch`."""
  import dataclasses
  import jax
  import jax.numpy as jnp
  from d2f_jax.models.moe import moe_mlp
  moe = dataclasses.replace(config.moe, dispatch=dispatch)
  x, e, f = moe.num_experts, config.embed_dim, moe.expert_mlp_dim
  bf16 = jnp.bfloat16
  weights = {"router": jax.ShapeDtypeStruct((e, x), bf16), "expert_gate": jax.ShapeDtypeStruct((x, e, f), bf16),
             "expert_up": jax.ShapeDtypeStruct((x, e, f), bf16), "expert_down": jax.ShapeDtypeStruct((x, f, e), bf16)}
  if moe.expert_bias:
    weights["expert_bias"] = jax.ShapeDtypeStruct((x,), jnp.float32)
  if moe.num_shared_experts:
    s = moe.shared_mlp_dim
    weights.update(shared_gate=jax.ShapeDtypeStruct((e, s), bf16), shared_up=jax.ShapeDtypeStruct((e, s), bf16),
                   shared_down=jax.ShapeDtypeStruct((s, e), bf16))
  hidden = jax.ShapeDtypeStruct((1, tokens, e), bf16)  # [B=1, N, E]: the layer sees B * T tokens alike
  return (lambda h, w: moe_mlp(h, w, moe)[0]), (hidden, weights)


def compile_costs(target, model: str, token_counts: list[int], log=print) -> dict:
  """{dispatch: {N: {'flops', 'bytes'}}} of one chip of `target`."""
  import jax
  from d2f_jax.bench.cost.compiled import cost_of
  from d2f_jax.models import preset
  topo.configure_jax(target.platform)
  device = topo.devices(target)[0]
  config = preset(model, dtype="bfloat16", param_dtype="bfloat16")
  if config.moe is None:
    raise ValueError(f"--model {model}: not a mixture-of-experts preset")
  out = {d: {} for d in DISPATCHES}
  sharding = jax.sharding.SingleDeviceSharding(device)
  for dispatch in DISPATCHES:
    for n in token_counts:
      fn, args = layer_program(config, n, dispatch)
      args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), args)
      out[dispatch][str(n)] = cost_of(jax.jit(fn).lower(*args).compile())
      log(f"  {target.name} {dispatch:6s} N={n}: {out[dispatch][str(n)]}")
  return out


def _cheaper(dense_ms: float, ragged_ms: float) -> str:
  """Dense only where it is priced more than MARGIN cheaper: ragged is the default."""
  return "dense" if dense_ms < (1 - MARGIN) * ragged_ms else "ragged"


def segments(ms: dict[str, dict[int, float]]) -> list[list]:
  """The cheaper dispatch per measured N as ordered segments [[largest N, dispatch], ..., [None, dispatch]]:
  a forward of n tokens takes the first segment whose largest N is >= n. Dense must be cheaper by more than
  MARGIN to be chosen (ragged is the default; a few percent is inside what a data-sheet price can tell)."""
  counts = sorted(ms["dense"])
  cheaper = [_cheaper(ms["dense"][n], ms["ragged"][n]) for n in counts]
  out = []
  for n, choice in zip(counts, cheaper):
    if out and out[-1][1] == choice:
      out[-1][0] = n
    else:
      out.append([n, choice])
  out[-1][0] = None  # the last choice holds beyond the largest N measured
  return out


def report(target_name: str, kind: str, costs: dict) -> dict:
  """One target's costs priced on its data sheet (ms per dispatch and N) and the segments of the cheaper."""
  from d2f_jax.bench.cost.model import milliseconds
  sheet = CPU_SHEET if kind == "cpu" else datasheets.by_name(SHEETS[kind])
  ms = {d: {int(n): milliseconds(c, sheet) for n, c in costs[d].items()} for d in DISPATCHES}
  return {"target": target_name, "datasheet": sheet.name, "costs": costs,
          "ms": {d: {str(n): v for n, v in ms[d].items()} for d in DISPATCHES}, "segments": segments(ms)}


def _child(target, args, path: str) -> None:
  """Compile `target` in the venv of its compiler (a child process), which writes its costs to `path`."""
  status = topo.run_with_compiler(target, args.accel_venvs, ["d2f_jax.bench", "moe_dispatch", "--model", args.model,
                                                             "--tokens", args.tokens, "--target", target.name,
                                                             "--child_json", path])
  if status:
    raise SystemExit(f"error: the {target.name} compile (a child in {args.accel_venvs}) exited {status}")


def main(argv: list[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  args = build_parser().parse_args(argv)
  tokens = sorted({int(v) for v in args.tokens.split(",") if v.strip()})
  if not tokens or tokens[0] <= 0:
    raise SystemExit(f"error: --tokens {args.tokens!r}: expected positive ints")
  targets = [topo.parse_target(t) for t in (args.target or ["h100", "v5e-1", "v6e-1", "cpu"])]
  if args.child_json:
    with open(args.child_json, "w") as f:
      json.dump(compile_costs(targets[0], args.model, tokens), f)
    return 0
  reports = []
  for target in targets:
    print(f"== {args.model} MoE layer on {target.name}")
    if topo.has_compiler(target):
      costs = compile_costs(target, args.model, tokens)
    else:
      path = os.path.abspath(f"{args.json}.{target.name}.part")
      _child(target, args, path)
      with open(path) as f:
        costs = json.load(f)
      os.remove(path)
    reports.append(report(target.name, target.kind, costs))
  rows = [{"target": r["target"], "tokens": n, "dense ms": f"{r['ms']['dense'][str(n)]:.4f}",
           "ragged ms": f"{r['ms']['ragged'][str(n)]:.4f}",
           "cheaper": _cheaper(r["ms"]["dense"][str(n)], r["ms"]["ragged"][str(n)])}
          for r in reports for n in tokens]
  print(f"PROJECTION (compiled costs priced on data sheets): one {args.model} MoE layer, bf16")
  print(format_table(rows))
  for r in reports:
    rule = ", then ".join(f"{d} up to {n} tokens" if n else f"{d} beyond" for n, d in r["segments"])
    print(f"{r['target']}: {rule}")
  write_json(args.json, {"model": args.model, "tokens": tokens, "targets": reports})
  print(f"wrote {args.json}")
  return 0
