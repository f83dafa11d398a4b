"""The mixture-of-experts MLP of LLaDA2 (BailingMoeV2): a float32 sigmoid router with group-limited top-k,
the chosen experts' SwiGLUs combined in float32, and the shared experts added.

Two ways to compute the experts, the same numbers up to float32 summation order (ModelConfig.moe.dispatch):
- `ragged`: the (token, choice) pairs sorted by expert and run as one grouped matmul per projection
  (`lax.ragged_dot`), so each token computes only its k experts: what prefill and large batches need;
- `dense`: every expert on every token, weighted by a [N, X] combine matrix that is zero off the choices
  (applied before the down projection); no sort or gather: XLA:GPU's and XLA:CPU's path past a few tokens
  (and an independent check of `ragged`).
- `auto`: per forward, whichever the compiled costs price cheaper for its token count on the platform
  (AUTO_DISPATCH). A speed option, not the default: a token's float32 sums then depend on how many tokens
  share its forward (so on what shares its batch), and greedy tokens may change in rare ties.
Under a mesh layout with an expert axis, `ragged` runs expert-parallel (models/expert_parallel.py).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from d2f_jax.models.config import MoEConfig
from d2f_jax.models.expert_parallel import local_experts, sharded_experts, swiglu
from d2f_jax.sharding.layout import current_layout

ROUTER_EPS = 1e-20  # added to the chosen scores' sum before normalising, as the released router does

# dispatch="auto": per platform, ordered segments (largest token count or None, dispatch); a forward of n
# tokens takes the first whose count is >= n. The cheaper computation per token count by the compiled costs
# of one llada2-mini MoE layer priced on the chips' data sheets (`python -m d2f_jax.bench moe_dispatch`, its
# report shipped as bench/reports/moe_dispatch.json: gpu from h100, tpu from v5e-1, cpu from this host's
# compiler at nominal peaks; tests/test_moe_dispatch.py keeps the two equal). XLA:GPU and XLA:CPU run
# ragged_dot as every (token, choice) pair times every expert (k times dense's FLOPs), so ragged wins there
# only at a few tokens, where reading the dense path's buffers costs more; on TPU ragged computes only the
# chosen pairs and is never dearer. The token count is a device's (the forward's over its batch shards). The
# rule holds with an expert axis too (ragged then runs expert-parallel, dense over the sharded experts), and no
# size guard sends long forwards back to ragged: on GPU and CPU ragged's buffers are k times dense's, compiled
# for the 32-slot engine: llada2-mini on one H100 96.27 GiB ragged / 36.39 dense, llada2-flash on 8xH100
# (experts parallel) 156.81 / 29.27.
AUTO_DISPATCH = {"gpu": ((64, "ragged"), (None, "dense")), "tpu": ((None, "ragged"),),
                 "cpu": ((1, "ragged"), (None, "dense"))}
AUTO_SOURCES = {"gpu": "h100", "tpu": "v5e-1", "cpu": "cpu"}  # the report's target each platform's rule is from


def dispatch_for(moe: MoEConfig, tokens: int, platform: str) -> str:
  """The expert computation a forward of `tokens` tokens a device runs on `platform` ('cpu', 'gpu', 'tpu');
  a platform without a rule keeps ragged, the default."""
  if moe.dispatch != "auto":
    return moe.dispatch
  rule = AUTO_DISPATCH.get("gpu" if platform in ("gpu", "cuda", "rocm") else platform, ((None, "ragged"),))
  return next(d for limit, d in rule if limit is None or tokens <= limit)


def _auto_dispatch(moe: MoEConfig, batch: int, length: int) -> str:
  """dispatch="auto" for a traced forward of [batch, length] tokens under the active layout: the rule of the
  platform its mesh's devices are (a deviceless target's too; else the default backend's) at the tokens one
  device holds."""
  layout = current_layout()
  mesh = getattr(layout, "mesh", None)
  if mesh is None:
    return dispatch_for(moe, batch * length, jax.default_backend())
  shards = math.prod(mesh.shape[a] for a in layout.batch_split(batch))
  return dispatch_for(moe, batch // shards * length, mesh.devices.flat[0].platform)


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


def experts_dense(h: jax.Array, w: dict, experts: jax.Array, weights: jax.Array) -> jax.Array:
  """sum_k weight_k * expert_k(h) [N, E] in float32, computing every expert on every token. The combine
  weights (zero off the choices) scale each expert's activations before the down projection, so the
  per-expert outputs [N, X, E] are never formed: one contraction over (expert, hidden) a token."""
  dtype = h.dtype
  gate = jnp.einsum("ne,xef->nxf", h, w["expert_gate"].astype(dtype))  # [N, X, F]
  up = jnp.einsum("ne,xef->nxf", h, w["expert_up"].astype(dtype))
  num_experts = w["expert_gate"].shape[0]
  combine = (jax.nn.one_hot(experts, num_experts, dtype=jnp.float32) * weights[..., None]).sum(axis=1)  # [N, X]
  act = (swiglu(gate, up).astype(jnp.float32) * combine[:, :, None]).astype(dtype)  # [N, X, F]
  return jnp.einsum("nxf,xfe->ne", act, w["expert_down"].astype(dtype), preferred_element_type=jnp.float32)


def experts_ragged(h: jax.Array, w: dict, experts: jax.Array, weights: jax.Array) -> jax.Array:
  """sum_k weight_k * expert_k(h) [N, E] in float32, each token through its k experts only: the N * k
  (token, expert) pairs sorted by expert, one grouped matmul per projection."""
  return local_experts(h, experts, weights, w, 0)


def moe_mlp(h: jax.Array, w: dict, moe: MoEConfig) -> tuple[jax.Array, jax.Array]:
  """The MoE MLP of normed hidden states h [B, T, E] -> ([B, T, E] in h's dtype, the tokens each expert took
  [X] float32: the router's load, for training diagnostics)."""
  batch, length, embed = h.shape
  tokens = h.reshape(-1, embed)  # [N, E]
  with jax.named_scope("router"):
    experts, weights = route(tokens, w["router"], w.get("expert_bias"), moe)
  dispatch = _auto_dispatch(moe, batch, length) if moe.dispatch == "auto" else moe.dispatch
  with jax.named_scope("experts"):
    out = None if dispatch != "ragged" else sharded_experts(
        h, w, experts.reshape(batch, length, -1), weights.reshape(batch, length, -1))  # [B, T, E] or None
    if out is None:  # one device, no expert axis, or the dense dispatch
      compute = experts_ragged if dispatch == "ragged" else experts_dense
      out = compute(tokens, w, experts, weights)
    out = out.reshape(-1, embed).astype(h.dtype)  # [N, E]
  if moe.num_shared_experts:
    with jax.named_scope("shared_experts"):
      gate = jnp.einsum("ne,ef->nf", tokens, w["shared_gate"].astype(h.dtype))
      up = jnp.einsum("ne,ef->nf", tokens, w["shared_up"].astype(h.dtype))
      out = out + jnp.einsum("nf,fe->ne", swiglu(gate, up), w["shared_down"].astype(h.dtype))
  load = jnp.zeros((moe.num_experts,), jnp.float32).at[experts.reshape(-1)].add(1.0)
  return out.reshape(batch, length, embed), jax.lax.stop_gradient(load)
