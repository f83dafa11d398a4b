"""A stated roofline: tokens/s of LLaDA-8B on H100 and TPU v5p from the miniature's measured decoding shape.

This is a projection, not a measurement. Per forward (batch 1, bf16 weights and KV cache):
  FLOPs = 2 n (P_layers + E V) + 4 n (c + n) H D L     (matmuls of n window tokens; QK^T and PV over c + n keys)
  bytes = 2 (P_read + E V) + 2 n E + 2 * 2 L c K D      (every weight once, n embedding rows, K and V of c cached)
  time  = max(FLOPs / peak FLOP/s, bytes / HBM bandwidth)
with n the tokens the forward computes, c the cached tokens it attends to, P_layers the transformer layers'
parameters a token uses (a mixture of experts: its k routed experts), P_read those the forward reads (a
mixture of experts: the experts any of its tokens chose) and E V the output head. tokens/s = measured tokens
per forward / time. Host overhead, kernel efficiency and launch latency are left out, so real numbers are
lower; the ratios between methods are the point, and they follow from the measured tokens per forward and
window widths.
"""

from __future__ import annotations

import math

from d2f_jax import datasheets
from d2f_jax.models import LLADA_8B, ModelConfig

# Dense bf16 peak FLOP/s and HBM bandwidth (bytes/s), from d2f_jax/datasheets.json.
DEVICES = {name: (datasheets.by_name(name).bf16_tflops * 1e12, datasheets.by_name(name).hbm_gbps * 1e9)
           for name in ("H100 SXM", "TPU v5p")}
BYTES = 2  # bf16


def _attention_params(config: ModelConfig) -> int:
  e, h, k, d = config.embed_dim, config.num_heads, config.num_kv_heads, config.head_dim
  return e * h * d + 2 * e * k * d + h * d * e


def layer_params(config: ModelConfig) -> int:
  """Parameters of the transformer layers one token's matmuls use: attention, the dense MLP of dense layers
  and, in mixture-of-experts layers, the router, the shared experts and its k routed experts (the active
  parameters: what FLOPs scale with)."""
  e = config.embed_dim
  dense = config.dense_layers * 3 * e * config.mlp_dim
  moe = config.moe
  if moe is None:
    return config.num_layers * _attention_params(config) + dense
  expert = 3 * e * moe.expert_mlp_dim
  per_moe_layer = e * moe.num_experts + (moe.num_shared_experts + moe.experts_per_token) * expert
  moe_layers = config.num_layers - config.dense_layers
  return config.num_layers * _attention_params(config) + dense + moe_layers * per_moe_layer


def layer_params_read(config: ModelConfig, tokens: float) -> float:
  """Parameters of the transformer layers a forward over `tokens` tokens (all rows together) reads: every
  weight of a dense model; in mixture-of-experts layers only the routed experts some token chose, expected
  X (1 - (1 - k / X)^tokens) of the X experts under even routing (k at one token, all X as the batch grows)."""
  moe = config.moe
  if moe is None:
    return float(layer_params(config))
  x, k = moe.num_experts, moe.experts_per_token
  touched = x * (1.0 - (1.0 - k / x) ** max(tokens, 1.0))  # expected distinct experts per MoE layer
  extra = (touched - k) * 3 * config.embed_dim * moe.expert_mlp_dim  # beyond the k counted as active
  return float(layer_params(config)) + (config.num_layers - config.dense_layers) * extra


def roofline_forward(config: ModelConfig, n: float, c: float, rows: int = 1) -> tuple[float, float]:
  """(FLOPs, bytes) of one forward of `rows` rows, each computing `n` tokens against `c` cached ones."""
  head = config.embed_dim * config.vocab_size
  attention = 4 * n * (c + n) * config.num_heads * config.head_dim * config.num_layers
  flops = rows * (2 * n * (layer_params(config) + head) + attention)
  kv = 2 * config.num_layers * c * config.num_kv_heads * config.head_dim
  return flops, BYTES * (layer_params_read(config, rows * n) + head + rows * (n * config.embed_dim + kv))


def window_blocks(row: dict, block_size: int | None, batch: float = 1) -> float:
  """A d2f / threshold row's mean window in blocks of `block_size` (the decode block of the run) at `batch`: its
  measured positions per forward where the row has them and the block is known (a throughput mode: not whole
  blocks, maybe of another block size), else its window blocks. The row's own fields are its batch-1 window;
  `window_at_batch` holds those measured at larger batches, where a forward is as wide as its widest row:
  between two measured batches the window is linear in log2(batch), past the largest it is the largest's (a
  lower bound: a bigger batch's widest row is wider still)."""
  points = {1.0: _blocks(row, block_size), **{float(b): _blocks(stats, block_size)
                                             for b, stats in _measured_at_batch(row).items()}}
  batches = sorted(points)
  batch = min(max(float(batch), batches[0]), batches[-1])
  above = min(b for b in batches if b >= batch)
  below = max(b for b in batches if b <= batch)
  if above == below:
    return points[below]
  t = (math.log2(batch) - math.log2(below)) / (math.log2(above) - math.log2(below))
  return (1 - t) * points[below] + t * points[above]


def window_batch(row: dict, batch: float) -> int:
  """The largest batch <= `batch` at which the row's window was measured (1: its own, for results written
  before `window_at_batch`): how far window_blocks at `batch` rests on a measurement."""
  return max([1] + [int(b) for b in _measured_at_batch(row) if int(b) <= batch])


def _measured_at_batch(row: dict) -> dict[str, dict]:
  """The row's `window_at_batch` entries that hold a window ({} for a method without one, or older results)."""
  return {b: stats for b, stats in (row.get("window_at_batch") or {}).items()
          if stats and (stats.get("mean_window_positions") or stats.get("mean_window_blocks"))}


def _blocks(stats: dict, block_size: int | None) -> float:
  positions = stats.get("mean_window_positions")
  return positions / block_size if positions and block_size else stats["mean_window_blocks"]


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
