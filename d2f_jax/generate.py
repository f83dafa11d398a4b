"""Command line generation: `python -m d2f_jax.generate --model PATH --prompt "..." [--method d2f ...]`.

Streams the response as it settles (host-driven steps, so text appears block by block), or with
`--no_stream` runs the whole generation as one jitted loop and prints it; then reports tokens/s and
tokens per forward. `--mesh data=1,tensor=8` decodes with the weights split over 8 devices (all processes'
devices under --distributed: every process runs the same prompt; process 0 prints).
"""

from __future__ import annotations

import argparse
import sys
import time

from d2f_jax.decode import generate, stream
from d2f_jax.decode.flags import (add_decode_flags, add_device_flags, add_model_flags, check_model_flags,
                                  decode_config_from_flags)
from d2f_jax.decode.limits import DecodeInputError
from d2f_jax.usage import ArgumentParser, UsageError, command


def build_parser() -> argparse.ArgumentParser:
  p = ArgumentParser("python -m d2f_jax.generate", __doc__)
  add_model_flags(p)
  group = p.add_mutually_exclusive_group(required=True)
  group.add_argument("--prompt", help="prompt text")
  group.add_argument("--prompt_ids", help="comma-separated prompt token ids (no tokenizer needed)")
  p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
  add_decode_flags(p)
  add_device_flags(p)
  p.add_argument("--seed", type=int, default=0, help="sampling seed (with --temperature > 0)")
  p.add_argument("--no_stream", action="store_true", help="one jitted loop, print at the end")
  p.add_argument("--warmup", action="store_true", help="compile with one run first, so timings exclude it")
  return p


def _prompt_ids(model, args) -> list[int]:
  if args.prompt_ids is not None:
    pieces = [t.strip() for t in args.prompt_ids.split(",")]
    if not all(t.lstrip("-").isdigit() for t in pieces):  # an empty piece ("1,,2") is an error, not skipped
      raise DecodeInputError(f"--prompt_ids must be comma-separated integers, got {args.prompt_ids!r}")
    return [int(t) for t in pieces]
  if model.tokenizer is None:
    raise UsageError(f"{args.model!r} has no tokenizer; pass --prompt_ids instead of --prompt")
  if args.chat and not getattr(model.tokenizer, "chat_template", None):
    print("warning: the tokenizer has no chat template; using the raw prompt", file=sys.stderr)
    return model.encode(args.prompt)
  return model.encode(args.prompt, chat=args.chat)


def _text(model, ids) -> str:
  return " ".join(map(str, ids)) if model.tokenizer is None else model.decode(ids)


@command
def main(argv: list[str] | None = None) -> dict:
  args = build_parser().parse_args(argv)
  config = decode_config_from_flags(args)
  check_model_flags(args)
  from d2f_jax.decode.flags import setup_devices
  mesh = setup_devices(args)  # before any other JAX call (jax.distributed)
  import jax

  if jax.process_count() > 1 and not args.no_stream:
    raise UsageError("streaming reads the state on one process; pass --no_stream with several processes")
  from d2f_jax.api import load_from_flags
  model = load_from_flags(args, mesh)
  from d2f_jax.decode.methods import check_method_fits, model_attention
  try:
    check_method_fits(model.config, config, model_attention(model))
  except ValueError as e:
    raise UsageError(f"--method {args.method} does not fit {args.model}: {e}") from e
  say = print if jax.process_index() == 0 else (lambda *a, **k: None)
  key = jax.random.key(args.seed)
  try:
    return _decode(model, _prompt_ids(model, args), config, key, args, mesh, say)
  except DecodeInputError as e:  # ids, positions or memory: named, before anything compiled
    raise UsageError(str(e)) from None


def _decode(model, prompt, config, key, args, mesh, say) -> dict:
  import jax
  if args.warmup:
    jax.block_until_ready(generate(model, [prompt], config, key=key))

  start = time.perf_counter()
  if args.no_stream:
    result = generate(model, [prompt], config, key=key)
    ids, forwards = result.to_lists()[0], int(result.forwards[0])
    say(_text(model, ids), flush=True)
  else:
    ids, forwards, shown = [], 0, ""
    for chunk in stream(model, prompt, config, key=key):
      ids += chunk.ids
      forwards = chunk.forwards
      text = _text(model, ids)
      new = text[len(shown):] if text.startswith(shown) else "\n" + text
      print(new, end="", flush=True)
      shown = text
    print(flush=True)
  seconds = time.perf_counter() - start
  stats = dict(prompt_tokens=len(prompt), tokens=len(ids), forwards=forwards, seconds=seconds,
               tokens_per_s=len(ids) / seconds if seconds > 0 else float("nan"),
               tokens_per_forward=len(ids) / forwards if forwards else float("nan"))
  note = "" if args.warmup else " (includes compilation; --warmup excludes it)"
  devices = "" if mesh is None else f" on mesh {dict(mesh.shape)}"
  say(f"[{args.method}] {stats['tokens']} tokens in {stats['forwards']} forwards "
      f"({stats['tokens_per_forward']:.2f} tokens/forward), {seconds:.2f}s, {stats['tokens_per_s']:.1f} tokens/s"
      f"{devices}{note}", file=sys.stderr)
  return stats


if __name__ == "__main__":
  main(sys.argv[1:])
