"""`python -m d2f_jax.bench attention` runs end to end on CPU (quick sizes, reference and both interpreters)."""

import json

from d2f_jax.bench import attention


def test_attention_bench_quick(tmp_path):
  out = tmp_path / "bench_attention.json"
  rows = attention.main(["--quick", "--iters", "1", "--out", str(out)])
  report = json.loads(out.read_text())
  assert report["benchmark"] == "attention" and report["rows"] == rows
  assert {r["impl"] for r in rows} == {"xla", "interpret_gpu", "interpret_tpu"}
  assert {r["kernel"] for r in rows} == {"window", "flash_fwd", "flash_fwd_bwd"}
  for row in rows:
    assert row["ms"] > 0 and row["max_err"] < 5e-2, row  # bf16 kernels against the fp32-softmax reference
  assert report["roofline"]["peak_tflops"] > 0 and report["roofline"]["peak_gbps"] > 0
