"""A stated roofline: tokens/s of LLaDA-8B on H100 and TPU v5p from the miniature's measured decoding shape.

This is a projection, not a measurement. Per forward (batch 1, bf16 weights and KV cache):
  FLOPs = 2 n (P_layers + E V) + 4 n (c + n) H D L     (matmuls of n window tokens; QK^T and PV over c + n keys)
  bytes = 2 (P_layers + E V) + 2 n E + 2 * 2 L c K D    (every weight once, n embedding rows, K and V of c cached)
  time  = max(FLOPs / peak FLOP/s, bytes / HBM bandwidth)
with n the tokens the forward computes, c the cached tokens it attends to, P_layers the transformer layers'
parameters and E V the output head. tokens/s = measured tokens per forward / time. Host overhead, kernel
efficiency and launch latency are left out, so real numbers are lower; the ratios between methods are the
point, and they follow from the measured tokens per forward and window widths.
"""

from __future__ import annotations

from d2f_jax import datasheets
from d2f_jax.models import LLADA_8B, ModelConfig

# Dense bf16 peak FLOP/s and HBM bandwidth (bytes/s), from d2f_jax/datasheets.json.
DEVICES = {name: (datasheets.by_name(name).bf16_tflops * 1e12, datasheets.by_name(name).hbm_gbps * 1e9)
           for name in ("H100 SXM", "TPU v5p")}
BYTES = 2  # bf16


def layer_params(config: ModelConfig) -> int:
  e, h, k, d, m = config.embed_dim, config.num_heads, config.num_kv_heads, config.head_dim, config.mlp_dim
  per_layer = e * h * d + 2 * e * k * d + h * d * e + 3 * e * m
  return config.num_layers * per_layer


def roofline_forward(config: ModelConfig, n: float, c: float) -> tuple[float, float]:
  """(FLOPs, bytes) of one forward computing `n` tokens against `c` cached ones."""
  matmul = layer_params(config) + config.embed_dim * config.vocab_size
  attention = 4 * n * (c + n) * config.num_heads * config.head_dim * config.num_layers
  flops = 2 * n * matmul + attention
  kv = 2 * config.num_layers * c * config.num_kv_heads * config.head_dim
  return flops, BYTES * (matmul + n * config.embed_dim + kv)


def window_blocks(row: dict, block_size: int) -> float:
  """A d2f / threshold row's mean window in blocks of `block_size` (the decode block of the run): its measured
  positions per forward where the row has them (a throughput mode: not whole blocks, maybe of another block
  size), else its window blocks."""
  positions = row.get("mean_window_positions")
  return positions / block_size if positions else row["mean_window_blocks"]


def forward_shape(row: dict, block_size: int, max_new_tokens: int) -> tuple[float, float]:
  """(n, c) of a row's mean forward: the measured window (d2f, threshold), the whole sequence without a
  cache (vanilla, dream_vanilla) or one token (ar); c = the prompt plus half the response."""
  prompt = row["prompt_tokens_mean"]
  if row["method"] in ("vanilla", "dream_vanilla"):
    return prompt + max_new_tokens, 0.0
  if row["method"] == "ar":
    return 1.0, prompt + max_new_tokens / 2
  return window_blocks(row, block_size) * block_size, prompt + max_new_tokens / 2


def project(rows: list[dict], block_size: int, max_new_tokens: int, config: ModelConfig = LLADA_8B) -> list[dict]:
  out = []
  for row in rows:
    if not row.get("tokens_per_forward"):
      continue
    n, c = forward_shape(row, block_size, max_new_tokens)
    flops, nbytes = roofline_forward(config, n, c)
    entry = {"method": row["method"], "settings": row["settings"], "tokens_per_forward": row["tokens_per_forward"],
             "tokens_per_fwd_window": n}
    for device, (peak, bandwidth) in DEVICES.items():
      seconds = max(flops / peak, nbytes / bandwidth)
      entry[f"{device} ms/fwd"] = 1000 * seconds
      entry[f"{device} tok/s"] = row["tokens_per_forward"] / seconds
    entry["bound"] = "compute" if flops / DEVICES["H100 SXM"][0] > nbytes / DEVICES["H100 SXM"][1] else "memory"
    out.append(entry)
  return out
