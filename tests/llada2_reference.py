"""An independent float64 numpy forward of a LLaDA2 (BailingMoeV2) checkpoint, read straight from its
Hugging Face tensors and config.json and written from the released remote code's semantics, for the tests:
fused query_key_value split [Q heads | K heads | V heads], per-head q / k RMSNorm before a rotate-half RoPE on
the first rotary dims, block-diffusion attention (key j visible to query i iff j // block <= i // block),
dense MLPs in the first `first_k_dense_replace` layers, then a sigmoid router: bias for choosing only, the
top-`topk_group` groups by their two best biased scores, the top experts among them, unbiased scores
normalised (+1e-20) and scaled, each expert looped over its tokens, the shared expert added.
"""

from __future__ import annotations

import json
import os

import numpy as np
from safetensors.numpy import load_file


def load(hf_dir: str) -> tuple[dict, dict[str, np.ndarray]]:
  with open(os.path.join(hf_dir, "config.json")) as f:
    config = json.load(f)
  return config, {k: v.astype(np.float64) for k, v in load_file(os.path.join(hf_dir, "model.safetensors")).items()}


def _rms(x, w, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _silu(x):
  return x / (1.0 + np.exp(-x))


def _mlp(x, t, prefix):
  gate, up, down = (t[f"{prefix}.{n}_proj.weight"] for n in ("gate", "up", "down"))
  return (_silu(x @ gate.T) * (x @ up.T)) @ down.T


def _rope(x, positions, theta, rotary):
  """x [T, N, D]: rotate-half RoPE on dims [0, rotary), the rest unchanged."""
  inv = 1.0 / theta ** (np.arange(0, rotary, 2) / rotary)
  ang = positions[:, None] * inv[None]  # [T, R/2]
  cos, sin = np.cos(np.concatenate([ang, ang], -1))[:, None], np.sin(np.concatenate([ang, ang], -1))[:, None]
  rot = x[..., :rotary]
  half = rotary // 2
  rotated = rot * cos + np.concatenate([-rot[..., half:], rot[..., :half]], -1) * sin
  return np.concatenate([rotated, x[..., rotary:]], -1)


def route(x, t, prefix, c):
  """(experts [T, k], weights [T, k]) as the released gate computes them."""
  scores = 1.0 / (1.0 + np.exp(-(x @ t[f"{prefix}.gate.weight"].T)))  # [T, X]
  biased = scores + t[f"{prefix}.gate.expert_bias"]
  n, groups, k = len(x), c["n_group"], c["num_experts_per_tok"]
  group_scores = np.sort(biased.reshape(n, groups, -1), axis=-1)[..., -2:].sum(-1)  # [T, G]
  kept = np.argsort(-group_scores, axis=-1, kind="stable")[:, :c["topk_group"]]
  allowed = np.zeros((n, groups), bool)
  np.put_along_axis(allowed, kept, True, axis=1)
  masked = np.where(np.repeat(allowed, c["num_experts"] // groups, axis=1), biased, -np.inf)
  experts = np.argsort(-masked, axis=-1, kind="stable")[:, :k]
  weights = np.take_along_axis(scores, experts, axis=1)
  if k > 1:
    weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
  return experts, weights * c["routed_scaling_factor"]


def _moe(x, t, prefix, c):
  experts, weights = route(x, t, prefix, c)
  out = np.zeros_like(x)
  for e in range(c["num_experts"]):
    rows, slot = np.nonzero(experts == e)
    if len(rows):
      out[rows] += _mlp(x[rows], t, f"{prefix}.experts.{e}") * weights[rows, slot][:, None]
  if c.get("num_shared_experts"):
    out = out + _mlp(x, t, f"{prefix}.shared_experts")
  return out


def logits(hf_dir: str, tokens: np.ndarray, block: int) -> np.ndarray:
  """Logits [T, V] of one row of token ids at positions 0..T-1 under the block-diffusion mask."""
  c, t = load(hf_dir)
  eps, heads, kv_heads = c["rms_norm_eps"], c["num_attention_heads"], c["num_key_value_heads"]
  d = c["head_dim"]
  rotary = int(d * c["partial_rotary_factor"])
  n = len(tokens)
  positions = np.arange(n, dtype=np.float64)
  visible = (np.arange(n)[None, :] // block) <= (np.arange(n)[:, None] // block)  # [T(query), T(key)]
  x = t["model.word_embeddings.weight"][tokens]
  for i in range(c["num_hidden_layers"]):
    p = f"model.layers.{i}"
    h = _rms(x, t[f"{p}.input_layernorm.weight"], eps)
    qkv = (h @ t[f"{p}.attention.query_key_value.weight"].T).reshape(n, heads + 2 * kv_heads, d)
    q, k, v = qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
    q = _rope(_rms(q, t[f"{p}.attention.query_layernorm.weight"], eps), positions, c["rope_theta"], rotary)
    k = _rope(_rms(k, t[f"{p}.attention.key_layernorm.weight"], eps), positions, c["rope_theta"], rotary)
    group = heads // kv_heads
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # kv head j serves q heads j*g .. j*g+g-1
    s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d)
    s = np.where(visible[None], s, -np.inf)
    a = np.exp(s - s.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    attn = np.einsum("hqk,khd->qhd", a, v).reshape(n, heads * d)
    x = x + attn @ t[f"{p}.attention.dense.weight"].T
    h = _rms(x, t[f"{p}.post_attention_layernorm.weight"], eps)
    x = x + (_mlp(h, t, f"{p}.mlp") if i < c["first_k_dense_replace"] else _moe(h, t, f"{p}.mlp", c))
  x = _rms(x, t["model.norm.weight"], eps)
  return x @ t["lm_head.weight"].T
