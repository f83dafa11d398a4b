"""One pre-norm transformer family for LLaDA, Dream (Qwen2 layout) and the causal AR baseline.

Layer weights are stacked on a leading `layers` axis. Training and prefill-free forwards apply them with
`lax.scan` (compile time flat in depth); a forward against a KV cache (a decode step, memory-bound) runs
them as a Python loop of static slices by default (`ModelConfig.layer_loop`), which every compiler reads
in place. In a scan the attention kernel reads the stacked cache at the scan's counter (in place on TPU),
but the GPU compiler copies every weight slice out, and the TPU one some (config.py, LAYER_LOOPS). Every
parameter carries logical axis names (embed, heads, kv_heads, head_dim, mlp, vocab, layers, lora_rank;
heads packed with head_dim as "heads:D") for sharding rules.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from d2f_jax import kernels
from d2f_jax.models import layers as L
from d2f_jax.models.config import LoraConfig, ModelConfig
from d2f_jax.models.kv_cache import KVCache
from d2f_jax.models.moe import moe_mlp
from d2f_jax.sharding.layout import constrain_batch
from d2f_jax.sharding.rules import packed_axis

# Every projection is stored as one [in, out] matrix per layer (HF's Linear transposed): heads are packed
# with their head_dim on one axis ("heads:D", sharded in whole heads), so a layer's slice is a plain 2-D
# operand (o's [H, D, E] slice was copied on GPU for its split-K matmul; in a scan on TPU every 3-D q / k / v
# slice was copied, where 2-D ones are mostly read in place).
_PROJ_IO = {"q": ("embed", "heads"), "k": ("embed", "kv_heads"), "v": ("embed", "kv_heads"),
            "o": ("heads", "embed"), "gate": ("embed", "mlp"), "up": ("embed", "mlp"), "down": ("mlp", "embed")}
PROJECTIONS: tuple[str, ...] = tuple(_PROJ_IO)
ATTENTION_PROJECTIONS: tuple[str, ...] = ("q", "k", "v", "o")


def proj_axes(name: str, config: ModelConfig) -> tuple[str, str]:
  """Logical axes (in, out) of projection `name`'s [in, out] matrix."""
  return tuple(packed_axis(a, config.head_dim) if a in ("heads", "kv_heads") else a for a in _PROJ_IO[name])


def proj_shape(name: str, config: ModelConfig) -> tuple[int, int]:
  """(in, out) of projection `name`: q [E, H*D], k / v [E, K*D], o [H*D, E], gate / up [E, F], down [F, E]."""
  c = config
  size = {"embed": c.embed_dim, "heads": c.num_heads * c.head_dim, "kv_heads": c.num_kv_heads * c.head_dim,
          "mlp": c.mlp_dim}
  return tuple(size[a] for a in _PROJ_IO[name])


def moe_param_layout(config: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
  """Per-layer (shape, logical axes) of a MoE layer's MLP weights: the router [E, X] (its selection bias
  [X], float32), the experts' gate / up [X, E, F] and down [X, F, E], the fused shared experts [E, Fs]."""
  c, moe = config, config.moe
  X, E, F = moe.num_experts, c.embed_dim, moe.expert_mlp_dim
  layout = {"router": ((E, X), ("embed", "expert"))}
  if moe.expert_bias:
    layout["expert_bias"] = ((X,), ("expert",))
  layout.update(expert_gate=((X, E, F), ("expert", "embed", "expert_mlp")),
                expert_up=((X, E, F), ("expert", "embed", "expert_mlp")),
                expert_down=((X, F, E), ("expert", "expert_mlp", "embed")))
  if moe.num_shared_experts:
    Fs = moe.shared_mlp_dim
    layout.update(shared_gate=((E, Fs), ("embed", "mlp")), shared_up=((E, Fs), ("embed", "mlp")),
                  shared_down=((Fs, E), ("mlp", "embed")))
  return layout


def _param(value, axes, kind=nnx.Param):
  return kind(value, out_sharding=axes, eager_sharding=False)


class StackedLayers(nnx.Module):
  """`count` decoder layers' weights, stacked [count, ...]: dense-MLP layers, or (`moe`) layers whose MLP is
  the mixture of experts of config.moe (models/moe.py)."""

  def __init__(self, config: ModelConfig, lora: LoraConfig | None, *, rngs: nnx.Rngs, count: int | None = None,
               moe: bool = False):
    c = config
    self.config = config
    self.lora = lora
    pdt = c.weight_dtype
    nl = c.num_layers if count is None else count
    self.attn_norm = _param(jnp.ones((nl, c.embed_dim), pdt), ("layers", "embed"))
    self.mlp_norm = _param(jnp.ones((nl, c.embed_dim), pdt), ("layers", "embed"))
    normal = lambda shape, fan_in: (jax.random.normal(rngs.params(), shape, jnp.float32) * fan_in ** -0.5).astype(pdt)
    for name in self.projections(moe):
      fan_in, fan_out = proj_shape(name, c)
      setattr(self, name, _param(normal((nl, fan_in, fan_out), fan_in), ("layers", *proj_axes(name, c))))
    if c.qkv_bias:
      self.q_bias = _param(jnp.zeros((nl, c.num_heads, c.head_dim), pdt), ("layers", "heads", "head_dim"))
      self.k_bias = _param(jnp.zeros((nl, c.num_kv_heads, c.head_dim), pdt), ("layers", "kv_heads", "head_dim"))
      self.v_bias = _param(jnp.zeros((nl, c.num_kv_heads, c.head_dim), pdt), ("layers", "kv_heads", "head_dim"))
    if c.qk_norm:
      self.q_norm = _param(jnp.ones((nl, c.head_dim), pdt), ("layers", "head_dim"))
      self.k_norm = _param(jnp.ones((nl, c.head_dim), pdt), ("layers", "head_dim"))
    if moe:
      for name, (shape, axes) in moe_param_layout(c).items():
        value = jnp.zeros((nl, *shape), jnp.float32) if name == "expert_bias" else normal((nl, *shape), shape[-2])
        setattr(self, name, _param(value, ("layers", *axes)))
    if lora is not None:
      for name in (t for t in lora.targets if t in self.projections(moe)):
        fan_in, fan_out = proj_shape(name, c)
        axis_in, axis_out = proj_axes(name, c)
        # PEFT's default: A ~ kaiming-uniform-ish, B = 0, so a fresh adapter is the identity update.
        a = jax.random.uniform(rngs.params(), (nl, fan_in, lora.rank), jnp.float32, -1.0, 1.0)
        a = a * (3.0 / fan_in) ** 0.5
        setattr(self, f"{name}_lora_a", _param(a.astype(pdt), ("layers", axis_in, "lora_rank"), nnx.LoRAParam))
        setattr(self, f"{name}_lora_b", _param(jnp.zeros((nl, lora.rank, fan_out), pdt),
                                               ("layers", "lora_rank", axis_out), nnx.LoRAParam))

  @staticmethod
  def projections(moe: bool) -> tuple[str, ...]:
    """The [in, out] projections of a layer: attention's, and the dense MLP's unless the MLP is experts."""
    return ATTENTION_PROJECTIONS if moe else PROJECTIONS

  def weights(self) -> dict[str, jax.Array]:
    """The stacked arrays as a plain dict, the scan's `xs`."""
    return {name: var[...] for name, var in vars(self).items() if isinstance(var, nnx.Variable)}


def _project(name: str, x: jax.Array, w: dict, lora: LoraConfig | None, dtype, dropout_key) -> jax.Array:
  """x [B, T, in] @ W [in, out] (+ scale * dropout(x) @ A @ B when `name` has an adapter) -> [B, T, out]."""
  with jax.named_scope(name):  # profiles and compiled modules name the projection
    out = jnp.einsum("bti,io->bto", x, w[name].astype(dtype))
    if lora is not None and name in lora.targets:
      xd = x
      if dropout_key is not None and lora.dropout > 0.0:
        keep = jax.random.bernoulli(dropout_key, 1.0 - lora.dropout, x.shape)
        xd = jnp.where(keep, x / (1.0 - lora.dropout), 0).astype(x.dtype)
      low = jnp.einsum("bti,ir->btr", xd, w[f"{name}_lora_a"].astype(dtype))
      out = out + lora.scale * jnp.einsum("btr,ro->bto", low, w[f"{name}_lora_b"].astype(dtype))
    return out


def _layer(config: ModelConfig, lora: LoraConfig | None, x, w, positions, q_ids, kv_ids, cache_kv, cache_len,
           dropout_key, layer: int | jax.Array | None = None):
  """One pre-norm block. x: [B, T, E]. Returns (x, (k, v)) with this window's k, v: [B, T, K, D].
  cache_kv: the stacked (k, v) [L, B, S, K, D] read at `layer` (a static int, or a scan's traced counter)."""
  dtype = config.compute_dtype
  keys = [None] * 7 if dropout_key is None else list(jax.random.split(dropout_key, 7))
  h = L.rms_norm(x, w["attn_norm"], config.norm_eps)
  h_k, h_v = h, h
  if cache_kv is not None:
    # Three operands XLA cannot prove equal: its dot merger would otherwise join the q, k, v matmuls into
    # one over concatenated weights, copying each layer's q/k/v slices of the stacked weights (a decode step
    # reads its weights once; those copies were ~1.9x its weight traffic on H100). Values are unchanged.
    h_k, h_v = jax.lax.optimization_barrier((h, h))
  heads = lambda y: y.reshape(*y.shape[:2], -1, config.head_dim)  # [B, T, n * D] -> [B, T, n, D]
  q = heads(_project("q", h, w, lora, dtype, keys[0]))  # [B, T, H, D]
  k = heads(_project("k", h_k, w, lora, dtype, keys[1]))  # [B, T, K, D]
  v = heads(_project("v", h_v, w, lora, dtype, keys[2]))
  if config.qkv_bias:
    q, k, v = q + w["q_bias"].astype(dtype), k + w["k_bias"].astype(dtype), v + w["v_bias"].astype(dtype)
  if config.qk_norm:  # per head, over head_dim, before the rotation (LLaDA2)
    q, k = L.rms_norm(q, w["q_norm"], config.norm_eps), L.rms_norm(k, w["k_norm"], config.norm_eps)
  q = L.rope(q, positions, config.rope_theta, config.rotary_dim)
  k = L.rope(k, positions, config.rope_theta, config.rotary_dim)
  if cache_kv is None:
    attn = kernels.attend(q, k, v, q_ids, kv_ids, impl=config.attention_impl)  # [B, T, H, D]
  else:
    cache_k, cache_v = cache_kv  # [B, S, K, D] or [L, B, S, K, D]; kv_ids = [cache ids | window ids]
    size = cache_k.shape[-3]
    # attend_window converts a cache kept in another dtype to q's (the compute dtype), one layer at a time
    attn = kernels.attend_window(q, k, v, q_ids, kv_ids[:, size:], cache_k, cache_v, kv_ids[:, :size], cache_len,
                                 layer=layer, impl=config.attention_impl)
  x = x + _project("o", attn.reshape(*attn.shape[:2], -1), w, lora, dtype, keys[3])  # attn [B, T, H * D]
  h = L.rms_norm(x, w["mlp_norm"], config.norm_eps)
  if "router" in w:  # a mixture-of-experts layer: its router's load [X] rides with the window's K/V
    out, load = moe_mlp(h, w, config.moe)
    return x + out, (k, v, load)
  gated = jax.nn.silu(_project("gate", h, w, lora, dtype, keys[4])) * _project("up", h, w, lora, dtype, keys[5])
  x = x + _project("down", gated, w, lora, dtype, keys[6])
  return x, (k, v)


class Transformer(nnx.Module):
  """Token ids + positions + attention ids -> logits (and this window's K/V for the cache)."""

  def __init__(self, config: ModelConfig, lora: LoraConfig | None = None, *, rngs: nnx.Rngs):
    self.config = config
    self.lora = lora
    c = config
    pdt = c.weight_dtype
    emb = jax.random.normal(rngs.params(), (c.vocab_size, c.embed_dim), jnp.float32) * 0.02
    self.embedding = _param(emb.astype(pdt), ("vocab", "embed"))
    self.layers = StackedLayers(config, lora, rngs=rngs, count=c.dense_layers)
    if c.moe is not None:
      self.moe_layers = StackedLayers(config, lora, rngs=rngs, count=c.num_layers - c.dense_layers, moe=True)
    self.final_norm = _param(jnp.ones((c.embed_dim,), pdt), ("embed",))
    if not c.tie_embeddings:
      head = jax.random.normal(rngs.params(), (c.embed_dim, c.vocab_size), jnp.float32) * c.embed_dim ** -0.5
      self.lm_head = _param(head.astype(pdt), ("embed", "vocab"))

  def hidden_states(self, tokens, positions, ids, cache: KVCache | None = None, *, dropout_key=None,
                    router_load: bool = False):
    """Final-normed hidden states [B, T, E] and the window's K/V stacked [L, B, T, K, D]; with `router_load`
    also the tokens each expert of each expert layer took [L - dense_layers, X] (None without experts)."""
    c = self.config
    x = constrain_batch(self.embedding[...].astype(c.compute_dtype)[tokens])  # [B, T, E]
    if cache is None:
      kv_ids = ids
    else:
      kv_ids = jnp.concatenate([cache.ids, ids], axis=1)  # [B, S + T]
    layer_keys = None if dropout_key is None else jax.random.split(dropout_key, c.num_layers)
    body = functools.partial(_layer, c, self.lora, positions=positions, q_ids=ids, kv_ids=kv_ids,
                             cache_len=None if cache is None else cache.length)
    cache_kv = None if cache is None else (cache.k, cache.v)  # [L, B, S, K, D] each: every stack's layers
    window_k, window_v, load = [], [], None
    for weights, first, count in self._stacks():  # the dense layers, then the mixture-of-experts ones
      keys = None if layer_keys is None else layer_keys[first:first + count]
      x, outputs = self._run_stack(body, x, weights, first, count, keys, cache_kv)
      window_k.append(outputs[0])
      window_v.append(outputs[1])
      load = outputs[2] if len(outputs) == 3 else load  # [n, X]
    k, v = (window_k[0], window_v[0]) if len(window_k) == 1 else (jnp.concatenate(window_k), jnp.concatenate(window_v))
    hidden, kv = self._after_cache_reads(x, k, v, cached=cache is not None)
    return (hidden, kv, load) if router_load else (hidden, kv)

  def _stacks(self) -> list[tuple[dict, int, int]]:
    """(stacked weights, index of their first layer, layer count) of each non-empty stack, in depth order."""
    c = self.config
    stacks = [(self.layers.weights(), 0, c.dense_layers)]
    if c.moe is not None:
      stacks.append((self.moe_layers.weights(), c.dense_layers, c.num_layers - c.dense_layers))
    return [stack for stack in stacks if stack[2]]

  def _run_stack(self, body, x, weights: dict, first: int, count: int, layer_keys, cache_kv):
    """Layers first .. first + count - 1 of one stack: a scan, or (ModelConfig.layer_loop) a Python loop of
    static slices. Returns x and the window's K/V [count, B, T, K, D] (and an expert stack's load [count, X])."""
    c, cached = self.config, cache_kv is not None

    def step(x, xs):
      w, layer, key = xs  # a scan reads the stacked cache whole, at its counter `layer`
      x, kv = body(x, w, cache_kv=cache_kv, layer=layer if cached else None, dropout_key=key)
      return constrain_batch(x), kv

    if c.remat:  # recompute each layer in the backward pass: activation memory O(1) in depth
      step = jax.checkpoint(step)
    if not c.unrolls_layers(cached=cached):
      counters = first + jnp.arange(count, dtype=jnp.int32)
      return jax.lax.scan(step, x, (weights, counters, layer_keys))
    window_kv = []
    for i in range(count):  # static slices: fused into the matmuls, and the kernel reads cache layer first + i
      block = functools.partial(body, cache_kv=cache_kv, layer=first + i if cached else None,
                                dropout_key=None if layer_keys is None else layer_keys[i])
      if c.remat:
        block = jax.checkpoint(block)
      x, kv = block(x, {name: value[i] for name, value in weights.items()})
      x = constrain_batch(x)
      window_kv.append(kv)
    return x, tuple(jnp.stack(parts) for parts in zip(*window_kv))  # k, v [n, B, T, K, D] (and load [n, X])

  def _after_cache_reads(self, x, k, v, *, cached: bool):
    """Final norm; against a cache, the window's K/V are tied to the last layer's output first, so the
    caller's in-place cache write is ordered after every layer has read the cache. Otherwise XLA may schedule
    the write before an early layer's attention kernel and copy the whole stacked cache to keep the old
    values for it (seen at batch 1 on H100: K and V copied twice each, 2.15 GB a step). Values unchanged."""
    if cached:  # x passes through unbarriered: its own values and fusions (hence numerics) stay as they were
      _, k, v = jax.lax.optimization_barrier((x, k, v))
    return L.rms_norm(x, self.final_norm[...], self.config.norm_eps), (k, v)

  def logits_from_hidden(self, hidden: jax.Array) -> jax.Array:
    """Raw logits [B, T, V] in fp32 (row i is the model's output at position i, before any Dream shift)."""
    c = self.config
    head = self.embedding[...].T if c.tie_embeddings else self.lm_head[...]  # [E, V]
    return jnp.einsum("bte,ev->btv", hidden, head.astype(c.compute_dtype), preferred_element_type=jnp.float32)

  def __call__(self, tokens, positions, ids, cache: KVCache | None = None, *, dropout_key=None):
    hidden, kv = self.hidden_states(tokens, positions, ids, cache, dropout_key=dropout_key)
    return self.logits_from_hidden(hidden), kv


def align_logits(logits: jax.Array, config: ModelConfig, previous: jax.Array | None = None,
                 valid: jax.Array | None = None) -> jax.Array:
  """Row i predicts token i. For Dream (logit_shift) row i takes output i-1; the first row takes `previous`
  (the output of the token before the window, e.g. the last cached position) or, without it, its own output.
  With left padding (`valid` [B, T]) the first valid row of each sequence keeps its own output."""
  if not config.logit_shift:
    return logits
  first = logits[:, :1] if previous is None else previous[:, None].astype(logits.dtype)
  shifted = jnp.concatenate([first, logits[:, :-1]], axis=1)
  if valid is not None and previous is None:
    is_first = valid & (jnp.cumsum(valid.astype(jnp.int32), axis=1) == 1)  # [B, T]
    shifted = jnp.where(is_first[..., None], logits, shifted)
  return shifted
