"""Convert LLaDA / Dream Hugging Face checkpoints (+ PEFT LoRA) to d2f_jax orbax directories, and back.

  HF -> converted:  --hf_dir DIR [--lora_dir DIR] [--merge_lora | --no-merge_lora] --out DIR
                    [--dtype bfloat16] [--allow_pickle] [--overwrite] [--allow_nonfinite]
  converted -> HF:  --to_hf --converted DIR [--out DIR] [--export_lora DIR] [--dtype D] [--max_shard_gb G]

Exit status: 0 written; 2 refused input (a bad checkpoint, config, option or output directory: one line
`error: ...` naming the file and field, nothing written); 143 stopped by SIGTERM (the partial output was
removed). Any other status is a bug and prints a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
import time

from d2f_jax.usage import EXIT_BAD_INPUT, ArgumentParser, UsageError, command  # noqa: F401 (EXIT_BAD_INPUT: API)

EXIT_TERMINATED = 143  # 128 + SIGTERM, what a shell reports for a process killed by SIGTERM


class Terminated(BaseException):
  """Raised in the main thread on SIGTERM, so every `atomic_dir` removes its temp dir on the way out."""


@contextlib.contextmanager
def _sigterm_raises():
  if threading.current_thread() is not threading.main_thread():
    yield
    return

  def handler(signum, frame):
    raise Terminated()
  previous = signal.signal(signal.SIGTERM, handler)
  try:
    yield
  finally:
    signal.signal(signal.SIGTERM, previous)


def build_parser() -> argparse.ArgumentParser:
  p = ArgumentParser("python -m d2f_jax.convert", __doc__)
  p.add_argument("--hf_dir", help="Hugging Face model directory (config.json + safetensors)")
  p.add_argument("--lora_dir", help="PEFT adapter directory (adapter_config.json + adapter_model.safetensors)")
  p.add_argument("--merge_lora", action=argparse.BooleanOptionalAction, default=False,
                 help="fold the adapter into the base weights (default: keep it as separate LoRA parameters)")
  p.add_argument("--out", help="output directory (converted dir, or HF dir with --to_hf)")
  p.add_argument("--dtype", help="storage dtype, e.g. bfloat16 or float32 (default: keep the source's)")
  p.add_argument("--allow_pickle", action="store_true", help="accept *.bin / *.pt weights (torch.load weights_only)")
  p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
  p.add_argument("--allow_nonfinite", action="store_true",
                 help="convert weights holding NaN / inf (refused by default, naming the tensor), for forensics")
  p.add_argument("--to_hf", action="store_true", help="export a converted directory back to Hugging Face form")
  p.add_argument("--converted", help="converted directory to export (with --to_hf)")
  p.add_argument("--export_lora", help="with --to_hf: write the separate LoRA as a PEFT adapter here")
  p.add_argument("--max_shard_gb", type=float, default=5.0, help="with --to_hf: max safetensors shard size in GB")
  p.add_argument("--no_progress", action="store_true", help="no progress bar")
  return p


@command
def main(argv: list[str] | None = None) -> None:
  """Run the CLI; a refused input raises SystemExit(2) after one `error:` line, SIGTERM SystemExit(143)."""
  parser = build_parser()
  args = parser.parse_args(argv)
  from d2f_jax.convert.errors import ConvertError, one_line  # after parsing, so --help stays fast
  from d2f_jax.workdir_lock import WorkdirLocked
  try:
    with _sigterm_raises():
      _run(parser, args)
  except Terminated:
    print("error: stopped by SIGTERM; the partial output was removed", file=sys.stderr)
    raise SystemExit(EXIT_TERMINATED) from None
  except (ConvertError, OSError, WorkdirLocked) as e:  # every refusal names its file / tensor / field (or process)
    raise UsageError(one_line(e)) from None


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
  from d2f_jax.convert import pipeline
  from d2f_jax.convert.util import as_numpy_dtype

  if args.dtype is not None:
    try:
      as_numpy_dtype(args.dtype)
    except ValueError as e:
      parser.error(f"--dtype: {e}")
  if not args.max_shard_gb > 0:
    parser.error(f"--max_shard_gb must be positive, got {args.max_shard_gb}")
  start = time.perf_counter()
  if args.to_hf:
    if not args.converted:
      parser.error("--to_hf needs --converted DIR")
    if not args.out and not args.export_lora:
      parser.error("--to_hf needs --out DIR and/or --export_lora DIR")
    written = pipeline.export_converted(args.converted, args.out, lora_out=args.export_lora, dtype=args.dtype,
                                        max_shard_bytes=int(args.max_shard_gb * 1e9), overwrite=args.overwrite,
                                        progress=not args.no_progress)
    for kind, path in written.items():
      print(f"wrote {kind}: {path}")
  else:
    if not args.hf_dir or not args.out:
      parser.error("needs --hf_dir DIR and --out DIR (or --to_hf --converted DIR)")
    out = pipeline.convert_hf_dir(args.hf_dir, args.out, lora_dir=args.lora_dir, merge=args.merge_lora,
                                  dtype=args.dtype, allow_pickle=args.allow_pickle, overwrite=args.overwrite,
                                  progress=not args.no_progress, allow_nonfinite=args.allow_nonfinite)
    print(f"wrote converted: {out}")
  print(f"done in {time.perf_counter() - start:.1f}s", file=sys.stderr)
