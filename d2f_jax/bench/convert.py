"""`python -m d2f_jax.bench convert`: wall time and peak memory of checkpoint conversion.

Writes a synthetic multi-shard bf16 LLaDA-format checkpoint (default ~2.2 GB), converts it to a d2f_jax
directory and back to Hugging Face form, each in a fresh subprocess (`python -m d2f_jax.convert`), and
reports peak RSS against max(largest shard, output size). The converter is meant to hold the model once:
target ratio < 1.3.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from d2f_jax.usage import ArgumentParser

TARGET_RATIO = 1.3
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def bench_config(size_gb: float):
  """A LLaDA-format bf16 config of about `size_gb` GB: the widest of a few widths with >= 2 layers."""
  from d2f_jax.models.config import ModelConfig
  target = size_gb * 1e9
  widths = [(2048, 5632, 32000, 16), (1024, 2816, 16000, 8), (256, 704, 4096, 4), (64, 160, 512, 4)]
  for E, F, V, H in widths:
    per_layer = 2 * (4 * E * E + 3 * E * F + 2 * E)
    fixed = 2 * (2 * V * E + E)
    layers = math.ceil((target - fixed) / per_layer)
    if layers >= 2 or (E, F, V, H) == widths[-1]:
      return ModelConfig(vocab_size=V, embed_dim=E, num_layers=max(2, layers), num_heads=H, num_kv_heads=H,
                         head_dim=E // H, mlp_dim=F, rope_theta=500000.0, mask_token_id=V - 4, eos_token_id=V - 3,
                         pad_token_id=V - 3, bos_token_id=V - 2, eot_token_id=V - 1, family="llada",
                         dtype="bfloat16", param_dtype="bfloat16")
  raise AssertionError("unreachable")


def _dir_bytes(path: str, suffix: str = "") -> tuple[int, int]:
  """(total bytes, largest file) of the files under `path` (ending in `suffix`)."""
  total = largest = 0
  for root, _, files in os.walk(path):
    for name in files:
      if name.endswith(suffix):
        size = os.path.getsize(os.path.join(root, name))
        total, largest = total + size, max(largest, size)
  return total, largest


def measure(cmd: list[str]) -> dict:
  """Run `cmd`, returning wall seconds and peak RSS (max of psutil polling of the process tree and the
  kernel's ru_maxrss for the child from wait4)."""
  import psutil
  env = dict(os.environ, PYTHONPATH=_REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu",
             TF_CPP_MIN_LOG_LEVEL="3")
  start = time.perf_counter()
  proc = subprocess.Popen(cmd, cwd=_REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  peak, done = [0], threading.Event()

  def poll():
    ps = psutil.Process(proc.pid)
    while not done.is_set():
      try:
        rss = ps.memory_info().rss + sum(c.memory_info().rss for c in ps.children(recursive=True))
        peak[0] = max(peak[0], rss)
      except psutil.Error:
        pass
      done.wait(0.02)

  thread = threading.Thread(target=poll, daemon=True)
  thread.start()
  output = proc.stdout.read().decode(errors="replace")
  _, status, usage = os.wait4(proc.pid, 0)
  proc.returncode = os.waitstatus_to_exitcode(status)
  seconds = time.perf_counter() - start
  done.set()
  thread.join()
  if proc.returncode != 0:
    raise RuntimeError(f"{' '.join(cmd)} failed with exit code {proc.returncode}:\n{output[-4000:]}")
  return {"seconds": seconds, "peak_rss_bytes": max(peak[0], usage.ru_maxrss * 1024),
          "ru_maxrss_bytes": usage.ru_maxrss * 1024, "polled_rss_bytes": peak[0]}


def run(args) -> dict:
  from d2f_jax.convert import synthetic
  config = bench_config(args.size_gb)
  work = tempfile.mkdtemp(prefix="d2f_bench_convert_", dir=args.workdir)
  hf_dir, conv_dir, back_dir = (os.path.join(work, n) for n in ("hf", "converted", "hf_back"))
  try:
    t0 = time.perf_counter()
    synthetic.write_hf_checkpoint(hf_dir, config, seed=0, dtype="bfloat16", shards=args.shards, tokenizer=False)
    write_seconds = time.perf_counter() - t0
    ckpt_bytes, largest_shard = _dir_bytes(hf_dir, ".safetensors")
    py = [sys.executable, "-m", "d2f_jax.convert", "--no_progress"]
    rows = []
    stats = measure(py + ["--hf_dir", hf_dir, "--out", conv_dir])
    out_bytes, _ = _dir_bytes(conv_dir)
    rows.append({"direction": "hf->converted", "checkpoint_gb": ckpt_bytes / 1e9,
                 "largest_shard_gb": largest_shard / 1e9, "output_gb": out_bytes / 1e9, **stats})
    stats = measure(py + ["--to_hf", "--converted", conv_dir, "--out", back_dir,
                          "--max_shard_gb", str(max(largest_shard, 1) / 1e9)])
    back_bytes, back_largest = _dir_bytes(back_dir, ".safetensors")
    rows.append({"direction": "converted->hf", "checkpoint_gb": out_bytes / 1e9,
                 "largest_shard_gb": back_largest / 1e9, "output_gb": back_bytes / 1e9, **stats})
  finally:
    if not args.keep:
      shutil.rmtree(work, ignore_errors=True)
  for row in rows:
    row["peak_rss_gb"] = row["peak_rss_bytes"] / 1e9
    row["ratio"] = row["peak_rss_gb"] / max(row["largest_shard_gb"], row["output_gb"])
  result = {"benchmark": "convert", "target_ratio": TARGET_RATIO, "shards": args.shards, "size_gb": args.size_gb,
            "synthetic_write_seconds": write_seconds, "config": dataclasses.asdict(config), "rows": rows,
            "ratio": rows[0]["ratio"], "page_cache": "warm (checkpoint just written)", "work_dir": work if args.keep
            else None}
  _print_table(rows)
  if args.out:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
      json.dump(result, f, indent=2)
      f.write("\n")
    print(f"wrote {args.out}")
  return result


def _print_table(rows: list[dict]) -> None:
  cols = [("direction", "{}"), ("checkpoint_gb", "{:.3f}"), ("largest_shard_gb", "{:.3f}"), ("output_gb", "{:.3f}"),
          ("seconds", "{:.1f}"), ("peak_rss_gb", "{:.3f}"), ("ratio", "{:.2f}")]
  cells = [[c for c, _ in cols]] + [[fmt.format(r[c]) for c, fmt in cols] for r in rows]
  widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
  for k, row in enumerate(cells):
    print(" | ".join(v.rjust(w) for v, w in zip(row, widths)))
    if k == 0:
      print("-+-".join("-" * w for w in widths))
  print(f"ratio = peak RSS / max(largest input shard, output); target < {TARGET_RATIO}")


def main(argv: list[str]) -> None:
  p = ArgumentParser("python -m d2f_jax.bench convert", __doc__)
  p.add_argument("--size_gb", type=float, default=2.2, help="synthetic checkpoint size (>= 2 for the real run)")
  p.add_argument("--shards", type=int, default=4, help="safetensors shards of the synthetic checkpoint")
  p.add_argument("--out", default="results/bench_convert.json", help="JSON results file ('' for none)")
  p.add_argument("--workdir", default=None, help="where the temporary checkpoints go (default: system temp)")
  p.add_argument("--keep", action="store_true", help="keep the temporary checkpoints")
  run(p.parse_args(argv))


if __name__ == "__main__":
  main(sys.argv[1:])
