"""Decoding benchmark: D2F vs its baselines, the jitted loop vs the same steps driven from Python, and the
window width set: ms per forward vs blocks in flight with one fixed full-width window (before) and with
the compiled width set (after), same run, same tokens.

`python -m d2f_jax.bench decode [--family tiny-llada] [--max_new_tokens 128] ...` on a random tiny model
(`--family tiny-llada2 --methods llada2,llada2_cached,d2f`: LLaDA2's released sampler, with its block cache).
Tokens per forward depend on confidences; an untrained model's are flat, so the model's head is scaled
(`--head_scale`, making top-1 probabilities spread over (0, 1) as a trained model's do) and tau_conf is
lowered from the paper's 0.9 (`--tau_conf`). Stop tokens are off so every method writes all tokens.
"""

from __future__ import annotations

import time

import jax
import numpy as np
from flax import nnx

from d2f_jax.reporting import format_table, write_report
from d2f_jax.usage import ArgumentParser
from d2f_jax.api import Model
from d2f_jax.decode import DecodeConfig, generate, generate_stepwise
from d2f_jax.models import Transformer, preset


# Small enough that per-step compute does not hide the per-step host overhead the jitted loop removes.
MICRO = preset("tiny-llada", embed_dim=32, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=16, mlp_dim=64)
# The main job's model shape (configs/tiny_e2e.py, Dream layout), for the window-width table.
E2E = preset("tiny-dream", vocab_size=96, embed_dim=128, num_layers=4, num_heads=4, num_kv_heads=4, head_dim=32,
             mlp_dim=384, mask_token_id=90, eos_token_id=91, pad_token_id=91, eot_token_id=93)
FAMILIES = {"micro-llada": MICRO, "e2e-dream": E2E}


def build_model(family: str, seed: int, head_scale: float) -> Model:
  config = FAMILIES[family] if family in FAMILIES else preset(family)
  if config.num_layers > 4:
    raise SystemExit(f"{family!r} is not a tiny preset; this benchmark builds random weights")
  module = Transformer(config, rngs=nnx.Rngs(seed))
  if not config.tie_embeddings:
    module.lm_head[...] = module.lm_head[...] * head_scale
  return Model.from_module(module)


def method_configs(args) -> dict[str, DecodeConfig]:
  common = dict(block_size=args.block_size, max_new_tokens=args.max_new_tokens, stop_ids=(),
                prompt_buckets=args.prompt_bucket)
  return {
      "d2f": DecodeConfig(method="d2f", max_blocks_in_flight=args.max_blocks_in_flight or None, tau_conf=args.tau_conf,
                          tau_add=args.tau_add, tau_act=args.tau_act, **common),
      "threshold": DecodeConfig(method="threshold", tau_conf=args.tau_conf, **common),
      "vanilla": DecodeConfig(method="vanilla", **common),  # one token per step
      "dream_vanilla": DecodeConfig(method="dream_vanilla", **common),
      "ar": DecodeConfig(method="ar", **common),
      "llada2": DecodeConfig(method="llada2", tau_conf=args.tau_conf, **common),  # the released loop
      "llada2_cached": DecodeConfig(method="llada2", tau_conf=args.tau_conf, block_cache=True, **common),
  }


def _time(fn, repeats: int):
  jax.block_until_ready(fn())  # compile (and warm caches) outside the timing
  best, result = float("inf"), None
  for _ in range(repeats):
    start = time.perf_counter()
    result = jax.block_until_ready(fn())
    best = min(best, time.perf_counter() - start)
  return best, result


def bench_family(family: str, args) -> list[dict]:
  model = build_model(family, args.seed, args.head_scale)
  rng = np.random.default_rng(args.seed)
  low = min(model.config.mask_token_id, model.config.eos_token_id, model.config.pad_token_id)
  prompts = rng.integers(0, low, size=(args.batch, args.prompt_len)).tolist()
  configs = method_configs(args)
  rows = []
  for name in args.methods.split(","):
    if name not in configs:
      raise SystemExit(f"unknown method {name!r}; choose from {', '.join(configs)}")
    loops = [("jit", generate)] + ([("host", generate_stepwise)] if name in args.host_methods.split(",") else [])
    jit_seconds = None
    for loop, fn in loops:
      seconds, result = _time(lambda: fn(model, prompts, configs[name]), args.repeats)
      tokens = int(np.asarray(result.lengths).sum())
      forwards = float(np.asarray(result.forwards).mean())
      jit_seconds = seconds if loop == "jit" else jit_seconds
      rows.append(dict(model=family, method=name, loop=loop, tokens=tokens, forwards=forwards,
                       tokens_per_forward=tokens / args.batch / forwards, seconds=seconds,
                       tokens_per_s=tokens / seconds, host_over_jit=seconds / jit_seconds if loop == "host" else ""))
  d2f = next(r for r in rows if r["method"] == "d2f" and r["loop"] == "jit") if "d2f" in args.methods else None
  for row in rows:
    row["d2f_speedup"] = d2f["tokens_per_s"] / row["tokens_per_s"] if d2f else ""
  return rows


def bench_widths(args) -> list[dict]:
  """ms per forward vs blocks in flight: the same d2f decodes (no cap on blocks in flight) with the widest
  window only (`window_widths=()`, before) and with the default width set (after). tau_add sets how many
  blocks fly at once; the tokens must agree exactly."""
  model = build_model(args.width_family, args.seed, args.head_scale)
  rng = np.random.default_rng(args.seed)
  low = min(model.config.mask_token_id, model.config.eos_token_id, model.config.pad_token_id)
  prompts = rng.integers(0, low, size=(1, args.prompt_len)).tolist()
  rows = []
  for tau_add in (float(t) for t in args.width_tau_add.split(",")):
    config = DecodeConfig(method="d2f", block_size=args.block_size, max_new_tokens=args.max_new_tokens,
                          tau_conf=args.width_tau_conf, tau_add=tau_add, tau_act=args.tau_act, stop_ids=(),
                          prompt_buckets=args.prompt_bucket)
    row = dict(model=args.width_family, tau_add=tau_add)
    tokens = {}
    for name, widths in (("fixed", ()), ("width_set", None)):
      seconds, result = _time(lambda: generate(model, prompts, config.replace(window_widths=widths)), args.repeats)
      forwards = int(np.asarray(result.forwards)[0])
      tokens[name] = np.asarray(result.tokens)
      row.update({"forwards": forwards, "in_flight": float(np.asarray(result.in_flight_sum)[0]) / forwards,
                  f"{name}_window": float(np.asarray(result.window_sum)[0]) / forwards,
                  f"{name}_ms_per_fwd": 1000 * seconds / forwards})
    if not np.array_equal(tokens["fixed"], tokens["width_set"]):
      raise AssertionError(f"tau_add={tau_add}: the width set changed the decoded tokens")
    row["speedup"] = row["fixed_ms_per_fwd"] / row["width_set_ms_per_fwd"]
    rows.append(row)
  return rows


def main(argv: list[str] | None = None) -> list[dict]:
  p = ArgumentParser("python -m d2f_jax.bench decode", __doc__)
  p.add_argument("--family", default="micro-llada,tiny-llada",
                 help="comma-separated model presets with random weights; micro-llada is a 1-layer width-32 "
                      "LLaDA whose step costs less than the host round trip the jitted loop removes")
  p.add_argument("--batch", type=int, default=1, help="prompts per generate call")
  p.add_argument("--prompt_len", type=int, default=32, help="prompt tokens")
  p.add_argument("--prompt_bucket", type=int, default=64, help="prompt lengths padded to a multiple of this")
  p.add_argument("--max_new_tokens", type=int, default=128, help="tokens to generate")
  p.add_argument("--block_size", type=int, default=8, help="tokens per block")
  p.add_argument("--max_blocks_in_flight", type=int, default=0, help="0: no cap (the default decoder)")
  p.add_argument("--tau_conf", type=float, default=0.5, help="lowered from 0.9 for an untrained model")
  p.add_argument("--tau_add", type=float, default=0.1, help="d2f: add a block once the newest is this decoded")
  p.add_argument("--tau_act", type=float, default=0.95, help="d2f: activate a block once its predecessor is this "
                                                              "decoded")
  p.add_argument("--head_scale", type=float, default=4.0, help="LM head scale, so confidences spread as a trained "
                                                                 "model's do")
  p.add_argument("--methods", default="d2f,threshold,vanilla,dream_vanilla,ar", help="comma-separated methods")
  p.add_argument("--host_methods", default="d2f,ar", help="methods also timed with the host-driven loop")
  p.add_argument("--repeats", type=int, default=10, help="timed calls per row (the best counts)")
  p.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompts")
  p.add_argument("--width_family", default="e2e-dream",
                 help="model of the window-width table (e2e-dream: the main job's shape); '' skips the table")
  p.add_argument("--width_tau_add", default="1.0,0.75,0.5,0.25,0.0",
                 help="tau_add values of the width table: 1 keeps one block in flight, 0 appends every step")
  p.add_argument("--width_tau_conf", type=float, default=0.9, help="tau_conf of the width table (the paper's)")
  p.add_argument("--out", default="results/bench_decode.json", help="JSON results file")
  args = p.parse_args(argv)

  rows = [row for family in args.family.split(",") for row in bench_family(family, args)] if args.family else []
  widths = bench_widths(args) if args.width_family else []
  if widths and rows:  # write_report prints `rows`; the width table is printed on its own
    print("ms per forward vs blocks in flight: fixed full-width window (before) vs the width set (after)")
    print(format_table(widths))
  write_report(args.out, "decode", rows or widths, args=vars(args), widths=widths,
               notes=f"random models with lm_head x{args.head_scale}; tau_conf {args.tau_conf} (paper 0.9) "
                     "because an untrained model is rarely that confident; stop tokens off; seconds = best of "
                     "repeats after a compile run; host = the same jitted step called from Python with a host "
                     "sync per step; host_over_jit = host seconds / jit seconds; d2f_speedup = d2f tok/s / "
                     "row tok/s. widths: one prompt, d2f with no cap; in_flight / *_window = mean blocks in "
                     "flight / window blocks per forward; fixed = the widest window every step (before), "
                     "width_set = the narrowest compiled width holding the blocks in flight (after); tokens "
                     "checked identical; speedup = fixed ms/fwd over width_set ms/fwd")
  return rows


if __name__ == "__main__":
  import sys
  main(sys.argv[1:])
