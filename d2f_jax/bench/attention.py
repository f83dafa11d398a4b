"""Attention kernels benchmark: window attention (decoding) and flash attention (training fwd / fwd+bwd).

`python -m d2f_jax.bench attention [--quick] [--impls xla,pallas]` sweeps LLaDA-8B (32 heads, 32 kv heads)
and Dream-7B (28 heads, 4 kv heads) attention shapes, checks every result against the jnp reference and
prints time, achieved HBM bandwidth (window: bytes of K/V that must be read) or useful FLOP rate (flash:
visible query-key pairs only) as a fraction of the device's roofline. On CPU the default is `--quick`:
reduced head counts and lengths, the reference plus both kernel interpreters, so the script itself is
exercised; interpreter timings say nothing about kernel speed.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from d2f_jax import datasheets
from d2f_jax.reporting import write_report
from d2f_jax.usage import ArgumentParser
from d2f_jax.kernels import flash_attention, window_attention, window_attention_reference
from d2f_jax.kernels.reference import PAD_ID, attention_reference
from d2f_jax.models.attention import attention_ids
from d2f_jax.train.metrics import measure_matmul_flops

MODELS = {"llada-8b": (32, 32), "dream-7b": (28, 4)}  # (query heads, kv heads); head_dim 128 for both
QUICK_MODELS = {"llada-like": (4, 4), "dream-like": (7, 1)}


def _time(fn, iters: int) -> tuple[float, object]:
  result = jax.block_until_ready(fn())  # compile outside the timing
  times = []
  for _ in range(iters):
    start = time.perf_counter()
    result = jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return float(np.median(times)), result


def roofline(iters: int = 3) -> dict:
  """Peak numbers of this device: the datasheet for known accelerators, measured on CPU."""
  device = jax.devices()[0]
  kind = getattr(device, "device_kind", str(device))
  if device.platform != "cpu":
    sheet = datasheets.for_device_kind(kind)
    if sheet is not None:
      return dict(device=sheet.name, device_kind=kind, peak_tflops=sheet.bf16_tflops, peak_gbps=sheet.hbm_gbps,
                  source="datasheet")
    return dict(device=kind, device_kind=kind, peak_tflops=None, peak_gbps=None, source="unknown device")
  flops = measure_matmul_flops(n=1024, repeats=iters)
  big = jnp.ones((32 * 2 ** 20,), jnp.float32)  # 128 MiB, read once per call
  total = jax.jit(jnp.sum)
  read_seconds, _ = _time(lambda: total(big), iters)
  return dict(device="cpu", device_kind=kind, peak_tflops=flops / 1e12,
              peak_gbps=big.nbytes / read_seconds / 1e9, source="measured (fp32 matmul, array sum)")


def _impl_options(impl: str) -> dict:
  if impl.startswith("interpret_"):
    return dict(impl="pallas", interpret=impl.removeprefix("interpret_"))
  return dict(impl=impl)


def _fraction(value, peak):
  return value / peak if peak else ""


def bench_window(model, heads, window, cache, impl, dtype, iters, peak, seed=0) -> dict:
  num_heads, num_kv_heads = heads
  batch, head_dim, block = 1, 128, 32
  length = cache - window  # the cache is sized for the sequence; the window is not in it yet
  rng = np.random.default_rng(seed)
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32).astype(dtype)
  q = normal(batch, window, num_heads, head_dim)
  k_win, v_win = normal(batch, window, num_kv_heads, head_dim), normal(batch, window, num_kv_heads, head_dim)
  cache_k, cache_v = normal(batch, cache, num_kv_heads, head_dim), normal(batch, cache, num_kv_heads, head_dim)
  slots = jnp.arange(cache)[None, :]
  cache_ids = jnp.where(slots < length, jnp.maximum(slots - 64, -1) // block, PAD_ID).astype(jnp.int32)
  win_ids = jnp.broadcast_to((length - 64) // block + 1 + jnp.arange(window) // block, (batch, window))
  args = (q, k_win, v_win, win_ids.astype(jnp.int32), win_ids.astype(jnp.int32), cache_k, cache_v, cache_ids,
          jnp.full((batch,), length, jnp.int32))
  fn = jax.jit(lambda *a: window_attention(*a, **_impl_options(impl)))
  seconds, out = _time(lambda: fn(*args), iters)
  expected = window_attention_reference(*args)
  itemsize = jnp.dtype(dtype).itemsize
  needed = 2 * batch * (length + window) * num_kv_heads * head_dim * itemsize  # K and V
  needed += 2 * q.size * itemsize  # q in, out
  gbps = needed / seconds / 1e9
  return dict(kernel="window", model=model, impl=impl, dtype=jnp.dtype(dtype).name, batch=batch, q_len=window,
              kv_len=cache, valid_kv=length, visible="", ms=seconds * 1e3,
              max_err=float(jnp.max(jnp.abs(out.astype(jnp.float32) - expected.astype(jnp.float32)))),
              gbps=gbps, tflops="", roofline=_fraction(gbps, peak["peak_gbps"]))


def bench_flash(model, heads, seq, impl, dtype, iters, peak, backward, seed=0) -> dict:
  num_heads, num_kv_heads = heads
  batch, head_dim = 1, 128
  rng = np.random.default_rng(seed)
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32).astype(dtype)
  q = normal(batch, seq, num_heads, head_dim)
  k, v = normal(batch, seq, num_kv_heads, head_dim), normal(batch, seq, num_kv_heads, head_dim)
  positions = jnp.broadcast_to(jnp.arange(seq), (batch, seq))
  ids = attention_ids(positions, "block_causal", prompt_len=seq // 4, block_size=16)  # D2F student pattern
  visible = float(jnp.mean(ids[:, None, :] <= ids[:, :, None]))  # fraction of query-key pairs computed
  cotangent = normal(batch, seq, num_heads, head_dim)
  options = _impl_options(impl)
  attend = lambda q, k, v: flash_attention(q, k, v, ids, ids, **options)
  reference = lambda q, k, v: attention_reference(q, k, v, ids, ids)
  if backward:
    grads = lambda f: jax.jit(jax.grad(lambda q, k, v: jnp.sum((f(q, k, v) * cotangent).astype(jnp.float32)),
                                       (0, 1, 2)))
    fn = grads(attend)
    seconds, out = _time(lambda: fn(q, k, v), iters)
    expected = grads(reference)(q, k, v)
    matmuls = 7  # forward 2 + backward 5 (scores, dV, dP, dQ, dK)
  else:
    fn = jax.jit(attend)
    seconds, out = _time(lambda: fn(q, k, v), iters)
    expected, matmuls = reference(q, k, v), 2
  err = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
            for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(expected)))
  useful = 2 * matmuls * batch * num_heads * seq * seq * head_dim * visible
  tflops = useful / seconds / 1e12
  return dict(kernel="flash_fwd_bwd" if backward else "flash_fwd", model=model, impl=impl,
              dtype=jnp.dtype(dtype).name, batch=batch, q_len=seq, kv_len=seq, valid_kv=seq, visible=round(visible, 3),
              ms=seconds * 1e3, max_err=err, gbps="", tflops=tflops, roofline=_fraction(tflops, peak["peak_tflops"]))


def main(argv: list[str] | None = None) -> list[dict]:
  on_cpu = jax.default_backend() == "cpu"
  p = ArgumentParser("python -m d2f_jax.bench attention", __doc__)
  p.add_argument("--quick", action=argparse.BooleanOptionalAction, default=on_cpu,
                 help="reduced sizes (default: on CPU only)")
  p.add_argument("--impls", default="xla,interpret_gpu,interpret_tpu" if on_cpu else "xla,pallas",
                 help="comma-separated: xla, auto, pallas, interpret_gpu, interpret_tpu (default: "
                      "xla,interpret_gpu,interpret_tpu on CPU, xla,pallas elsewhere)")
  p.add_argument("--kernels", default="window,flash_fwd,flash_fwd_bwd", help="comma-separated kernels to time")
  p.add_argument("--dtype", default="bfloat16", help="input dtype")
  p.add_argument("--iters", type=int, default=3 if on_cpu else 20, help="timed calls per row (default: 3 on CPU, "
                                                                      "20 elsewhere)")
  p.add_argument("--out", default="results/bench_attention.json", help="JSON results file")
  args = p.parse_args(argv)

  if args.quick:
    models, windows, caches, seqs = QUICK_MODELS, (32,), (256,), (128,)
  else:
    models, windows, caches, seqs = MODELS, (32, 64, 128), (512, 1024, 4096), (512, 1024, 2048)
  dtype = jnp.dtype(args.dtype)
  peak = roofline()
  print(f"roofline ({peak['source']}): {peak['device']}, {peak['peak_tflops']} TFLOP/s, {peak['peak_gbps']} GB/s")
  kernels = args.kernels.split(",")
  rows = []
  for impl in args.impls.split(","):
    for model, heads in models.items():
      if "window" in kernels:
        rows += [bench_window(model, heads, w, c, impl, dtype, args.iters, peak)
                 for w in windows for c in caches if c > w]
      for backward, name in ((False, "flash_fwd"), (True, "flash_fwd_bwd")):
        if name in kernels:
          rows += [bench_flash(model, heads, s, impl, dtype, args.iters, peak, backward) for s in seqs]
  write_report(args.out, "attention", rows, args=vars(args), roofline=peak,
               notes="valid_kv = cache slots written (window) or sequence length; ms = median of iters after a "
                     "compile run; window gbps = bytes of K/V (valid cache + window), "
                     "q and output / time; flash tflops = 2 * matmuls * B * H * T^2 * D * visible / time (visible = "
                     "fraction of query-key pairs the block-causal ids allow; skipped tiles are not counted); "
                     "roofline = gbps / peak_gbps or tflops / peak_tflops; max_err vs the jnp reference (grads "
                     "for fwd_bwd); interpret_* rows run the kernels in CPU interpreters: correctness only")
  return rows


if __name__ == "__main__":
  import sys
  main(sys.argv[1:])
