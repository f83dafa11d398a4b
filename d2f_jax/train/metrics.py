"""Throughput accounting (model FLOPs, device peak, MFU) and the TensorBoard writer.

FLOPs count useful model work per token: the teacher's forward (distillation only), the trained model's
forward, and its backward (activation gradients always; weight gradients of the base only in full
fine-tuning). Recomputation (remat, chunked logits) is overhead, not useful work, and is not counted.
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp

from d2f_jax.models import LoraConfig, ModelConfig

# Dense bf16 peak FLOP/s per JAX device, by device_kind prefix.
PEAK_FLOPS = {
    "TPU v6 lite": 918e12, "TPU v5p": 459e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v4": 275e12,
    "NVIDIA H200": 989e12, "NVIDIA H100": 989e12, "NVIDIA A100": 312e12, "NVIDIA L4": 121e12,
}


def forward_flops_per_token(config: ModelConfig, seq_len: int, lora: LoraConfig | None = None) -> float:
  """Matmul FLOPs of one forward per token: projections, MLP, LM head, attention scores and values."""
  c = config
  hd = c.head_dim
  proj = {"q": c.embed_dim * c.num_heads * hd, "k": c.embed_dim * c.num_kv_heads * hd,
          "v": c.embed_dim * c.num_kv_heads * hd, "o": c.num_heads * hd * c.embed_dim,
          "gate": c.embed_dim * c.mlp_dim, "up": c.embed_dim * c.mlp_dim, "down": c.mlp_dim * c.embed_dim}
  dims_in = {"q": c.embed_dim, "k": c.embed_dim, "v": c.embed_dim, "o": c.num_heads * hd, "gate": c.embed_dim,
             "up": c.embed_dim, "down": c.mlp_dim}
  per_layer = sum(proj.values())
  if lora is not None:
    per_layer += sum(lora.rank * (dims_in[t] + proj[t] // dims_in[t]) for t in lora.targets)
  attention = 2 * seq_len * c.num_heads * hd  # q k^T and p v, per token per layer (full length, no skipping)
  return 2.0 * (c.num_layers * (per_layer + attention) + c.embed_dim * c.vocab_size)


def train_flops_per_token(config: ModelConfig, seq_len: int, lora: LoraConfig | None, teacher: bool = True,
                          passes: int = 1) -> float:
  """[teacher fwd] + passes x (model fwd + model bwd: 2x fwd in full fine-tuning, 1x with LoRA, no base grads).

  teacher: distillation's frozen teacher forward (counted at the adapted size, like the student's); passes:
  the trained model's forward-backward passes a row takes (2 for mdm with `ar_weight`: masked and causal)."""
  fwd = forward_flops_per_token(config, seq_len, lora)
  return fwd * ((1.0 if teacher else 0.0) + passes * (1.0 + (1.0 if lora is not None else 2.0)))


def measure_matmul_flops(n: int = 2048, dtype=jnp.float32, repeats: int = 5) -> float:
  """Measured FLOP/s of an n x n x n matmul on the default device (best of `repeats`)."""
  a = jnp.ones((n, n), dtype)
  f = jax.jit(lambda x: x @ x)
  f(a).block_until_ready()
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    f(a).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return 2.0 * n ** 3 / best


def peak_flops_per_device(override: float | None = None) -> float | None:
  """`override`, else the device kind's table entry, else (CPU) a measured f32 matmul; None if unknown."""
  if override:
    return float(override)
  kind = jax.devices()[0].device_kind
  for prefix, flops in PEAK_FLOPS.items():
    if kind.startswith(prefix):
      return flops
  if jax.default_backend() == "cpu":
    return measure_matmul_flops(n=1024)
  return None


class Writer:
  """TensorBoard scalars under <workdir>/tb (process 0 only); a no-op elsewhere."""

  def __init__(self, workdir: str):
    self._writer = None
    if jax.process_index() == 0:
      from tensorboardX import SummaryWriter
      self._writer = SummaryWriter(os.path.join(workdir, "tb"))

  def scalars(self, step: int, values: dict) -> None:
    if self._writer is not None:
      for name, value in values.items():
        self._writer.add_scalar(name, float(value), step)

  def flush(self) -> None:
    if self._writer is not None:
      self._writer.flush()

  def close(self) -> None:
    if self._writer is not None:
      self._writer.close()
