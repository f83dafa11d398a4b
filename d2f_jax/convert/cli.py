"""`python -m d2f_jax.convert`: thin argparse front end of pipeline.py.

  HF -> converted:  --hf_dir DIR [--lora_dir DIR] [--merge_lora | --no-merge_lora] --out DIR
                    [--dtype bfloat16] [--allow_pickle] [--overwrite]
  converted -> HF:  --to_hf --converted DIR [--out DIR] [--export_lora DIR] [--dtype D] [--max_shard_gb G]
"""

from __future__ import annotations

import argparse
import sys
import time


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m d2f_jax.convert",
                              description="Convert LLaDA / Dream Hugging Face checkpoints (+ PEFT LoRA) to d2f_jax "
                                          "orbax directories, and back.")
  p.add_argument("--hf_dir", help="Hugging Face model directory (config.json + safetensors)")
  p.add_argument("--lora_dir", help="PEFT adapter directory (adapter_config.json + adapter_model.safetensors)")
  p.add_argument("--merge_lora", action=argparse.BooleanOptionalAction, default=False,
                 help="fold the adapter into the base weights (default: keep it as separate LoRA parameters)")
  p.add_argument("--out", help="output directory (converted dir, or HF dir with --to_hf)")
  p.add_argument("--dtype", help="storage dtype, e.g. bfloat16 or float32 (default: keep the source's)")
  p.add_argument("--allow_pickle", action="store_true", help="accept *.bin / *.pt weights (torch.load weights_only)")
  p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
  p.add_argument("--to_hf", action="store_true", help="export a converted directory back to Hugging Face form")
  p.add_argument("--converted", help="converted directory to export (with --to_hf)")
  p.add_argument("--export_lora", help="with --to_hf: write the separate LoRA as a PEFT adapter here")
  p.add_argument("--max_shard_gb", type=float, default=5.0, help="with --to_hf: max safetensors shard size in GB")
  p.add_argument("--no_progress", action="store_true", help="no progress bar")
  return p


def main(argv: list[str] | None = None) -> None:
  parser = build_parser()
  args = parser.parse_args(argv)
  from d2f_jax.convert import pipeline  # after parsing, so --help stays fast

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
                                  progress=not args.no_progress)
    print(f"wrote converted: {out}")
  print(f"done in {time.perf_counter() - start:.1f}s", file=sys.stderr)
