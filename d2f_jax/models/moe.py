"""The mixture-of-experts MLP of LLaDA2 (BailingMoeV2): a float32 sigmoid router with group-limited top-k,
the chosen experts' SwiGLUs combined in float32, and the shared experts added.

Two ways to compute the experts, the same numbers up to float32 summation order (ModelConfig.moe.dispatch):
- `ragged`: the (token, choice) pairs sorted by expert and run as one grouped matmul per projection
  (`lax.ragged_dot`), so each token computes only its k experts: what prefill and large batches need;
- `dense`: every expert on every token, weighted by a [N, X] combine matrix that is zero off the choices; no
  sort or gather, for the few tokens of a small decode step (and an independent check of `ragged`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from d2f_jax.models.config import MoEConfig

ROUTER_EPS = 1e-20  # added to the chosen scores' sum before normalising, as the released router does


def route(h: jax.Array, router: jax.Array, expert_bias: jax.Array | None,
          moe: MoEConfig) -> tuple[jax.Array, jax.Array]:
  """(experts [N, k] int32, weights [N, k] f32) for tokens h [N, E] and router weights [E, X].

  Scores are sigmoid(h @ router) in float32; the bias (if any) is added only to choose: the kept groups (the
  `groups_kept` contiguous groups whose two best biased scores sum highest) and the top k experts in them.
  The weights are the unbiased scores of the chosen experts, normalised to sum to 1 (k > 1) and scaled."""
  logits = jnp.einsum("ne,ex->nx", h.astype(jnp.float32), router.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)  # [N, X]
  scores = jax.nn.sigmoid(logits)
  biased = scores if expert_bias is None else scores + expert_bias.astype(jnp.float32)
  if moe.num_groups > 1:
    n = biased.shape[0]
    grouped = biased.reshape(n, moe.num_groups, -1)  # [N, G, X / G]
    group_scores = jax.lax.top_k(grouped, 2)[0].sum(axis=-1)  # [N, G]
    _, kept = jax.lax.top_k(group_scores, moe.groups_kept)  # [N, g]
    keep = jax.nn.one_hot(kept, moe.num_groups, dtype=jnp.bool_).any(axis=1)  # [N, G]
    biased = jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(n, -1)
  _, experts = jax.lax.top_k(biased, moe.experts_per_token)  # [N, k]
  weights = jnp.take_along_axis(scores, experts, axis=1)  # [N, k], unbiased
  if moe.experts_per_token > 1:
    weights = weights / (weights.sum(axis=-1, keepdims=True) + ROUTER_EPS)
  return experts.astype(jnp.int32), weights * moe.routed_scaling


def _swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
  return jax.nn.silu(gate) * up


def experts_dense(h: jax.Array, w: dict, experts: jax.Array, weights: jax.Array) -> jax.Array:
  """sum_k weight_k * expert_k(h) [N, E] in float32, computing every expert on every token."""
  dtype = h.dtype
  gate = jnp.einsum("ne,xef->nxf", h, w["expert_gate"].astype(dtype))  # [N, X, F]
  up = jnp.einsum("ne,xef->nxf", h, w["expert_up"].astype(dtype))
  out = jnp.einsum("nxf,xfe->nxe", _swiglu(gate, up), w["expert_down"].astype(dtype))  # [N, X, E]
  num_experts = w["expert_gate"].shape[0]
  combine = (jax.nn.one_hot(experts, num_experts, dtype=jnp.float32) * weights[..., None]).sum(axis=1)  # [N, X]
  return jnp.einsum("nxe,nx->ne", out.astype(jnp.float32), combine)


def experts_ragged(h: jax.Array, w: dict, experts: jax.Array, weights: jax.Array) -> jax.Array:
  """sum_k weight_k * expert_k(h) [N, E] in float32, each token through its k experts only: the N * k
  (token, expert) pairs sorted by expert, one grouped matmul per projection."""
  dtype = h.dtype
  n, k = experts.shape
  num_experts = w["expert_gate"].shape[0]
  flat = experts.reshape(-1)  # [N * k]
  order = jnp.argsort(flat, stable=True)  # pairs grouped by expert
  token = order // k  # [N * k]: the token of each sorted pair
  group_sizes = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)  # [X]
  rows = h[token]  # [N * k, E]
  gate = jax.lax.ragged_dot(rows, w["expert_gate"].astype(dtype), group_sizes)  # [N * k, F]
  up = jax.lax.ragged_dot(rows, w["expert_up"].astype(dtype), group_sizes)
  out = jax.lax.ragged_dot(_swiglu(gate, up), w["expert_down"].astype(dtype), group_sizes)  # [N * k, E]
  weighted = out.astype(jnp.float32) * weights.reshape(-1)[order][:, None]
  return jnp.zeros((n, h.shape[-1]), jnp.float32).at[token].add(weighted)


def moe_mlp(h: jax.Array, w: dict, moe: MoEConfig) -> tuple[jax.Array, jax.Array]:
  """The MoE MLP of normed hidden states h [B, T, E] -> ([B, T, E] in h's dtype, the tokens each expert took
  [X] float32: the router's load, for training diagnostics)."""
  batch, length, embed = h.shape
  tokens = h.reshape(-1, embed)  # [N, E]
  with jax.named_scope("router"):
    experts, weights = route(tokens, w["router"], w.get("expert_bias"), moe)
  compute = experts_ragged if moe.dispatch == "ragged" else experts_dense
  with jax.named_scope("experts"):
    out = compute(tokens, w, experts, weights).astype(h.dtype)  # [N, E]
  if moe.num_shared_experts:
    with jax.named_scope("shared_experts"):
      gate = jnp.einsum("ne,ef->nf", tokens, w["shared_gate"].astype(h.dtype))
      up = jnp.einsum("ne,ef->nf", tokens, w["shared_up"].astype(h.dtype))
      out = out + jnp.einsum("nf,fe->ne", _swiglu(gate, up), w["shared_down"].astype(h.dtype))
  load = jnp.zeros((moe.num_experts,), jnp.float32).at[experts.reshape(-1)].add(1.0)
  return out.reshape(batch, length, embed), jax.lax.stop_gradient(load)
