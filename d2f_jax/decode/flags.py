"""The decoding flags every command line shares (generate, evaluate), and the DecodeConfig they build."""

from __future__ import annotations

import argparse

from d2f_jax.decode.config import DREAM_ALGS, METHODS, DecodeConfig

_DEFAULTS = DecodeConfig()


def add_decode_flags(parser) -> None:
  """Add --method, --block_size, thresholds, sampling, steps, alg, --prompt_bucket and --stop_tokens."""
  parser.add_argument("--method", default=_DEFAULTS.method, choices=METHODS)
  parser.add_argument("--block_size", type=int, default=_DEFAULTS.block_size)
  parser.add_argument("--max_new_tokens", type=int, default=_DEFAULTS.max_new_tokens)
  parser.add_argument("--max_blocks_in_flight", type=int, default=_DEFAULTS.max_blocks_in_flight)
  parser.add_argument("--tau_add", type=float, default=_DEFAULTS.tau_add)
  parser.add_argument("--tau_act", type=float, default=_DEFAULTS.tau_act)
  parser.add_argument("--tau_conf", type=float, default=_DEFAULTS.tau_conf)
  parser.add_argument("--temperature", type=float, default=_DEFAULTS.temperature)
  parser.add_argument("--top_p", type=float, default=_DEFAULTS.top_p)
  parser.add_argument("--steps", type=int, default=None, help="vanilla / dream_vanilla steps (default: one per token)")
  parser.add_argument("--alg", default=_DEFAULTS.alg, choices=DREAM_ALGS)
  parser.add_argument("--prompt_bucket", type=int, default=_DEFAULTS.prompt_buckets,
                      help="pad prompt lengths to a multiple of this (fewer compiles, more padding)")
  parser.add_argument("--stop_tokens", default=None,
                      help="comma-separated stop ids; 'none' never stops early (default: eos and end-of-turn)")


def decode_config_from_flags(args: argparse.Namespace) -> DecodeConfig:
  """The DecodeConfig of parsed flags; a bad value exits with the option and what was expected."""
  stops = None
  if args.stop_tokens is not None:
    text = args.stop_tokens.strip().lower()
    try:
      stops = () if text == "none" else tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError as e:
      raise SystemExit(f"--stop_tokens must be comma-separated ints or 'none', got {args.stop_tokens!r}") from e
  try:
    return DecodeConfig(method=args.method, block_size=args.block_size, max_new_tokens=args.max_new_tokens,
                        max_blocks_in_flight=args.max_blocks_in_flight, tau_add=args.tau_add, tau_act=args.tau_act,
                        tau_conf=args.tau_conf, temperature=args.temperature, top_p=args.top_p, steps=args.steps,
                        alg=args.alg, stop_tokens=stops, prompt_buckets=args.prompt_bucket)
  except ValueError as e:
    raise SystemExit(f"bad decoding option: {e}") from e
