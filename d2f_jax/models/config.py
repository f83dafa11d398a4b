"""Static model configuration shared by LLaDA, Dream and the causal AR baseline.

The config is a frozen (hashable) dataclass so it can be a static argument of jitted
functions: changing it recompiles, changing parameters or inputs does not.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax.numpy as jnp

from d2f_jax.kernels.common import ATTENTION_IMPLS

Family = Literal["llada", "dream", "llada2", "custom"]
# How a model was trained to attend; decoding refuses a method that does not fit it (decode/config.py).
ATTENTION_KINDS: tuple[str, ...] = ("bidirectional", "block_causal", "causal")
# Attention implementation (see d2f_jax.kernels.attend): "xla" = the jnp reference, "auto" = Pallas kernels on
# GPU/TPU and the reference on CPU, "pallas" = kernels always, "interpret_*" = kernels in a CPU interpreter.
# How the layers run (models/transformer.py): "scan" = one lax.scan over the stacked weights (compile time flat
# in depth); "unroll" = a Python loop with static per-layer slices, read in place by every compiler; "auto" =
# unroll when decoding against a KV cache (a memory-bound step), scan otherwise. Inside a scan a layer's weights
# are dynamic slices and the window kernel reads the stacked cache at the scan's counter: in place on TPU (the
# cache and most weights; libtpu still copies q's and k's slices to feed its matmul a head-major output: 8 MiB
# a layer a device for LLaDA-8B on v5e-8), all copied on GPU (~2x a decode step's traffic). A scanned decode
# step compiles in a fraction of the unrolled one's time (docs/pods.md: compile times).
LAYER_LOOPS: tuple[str, ...] = ("auto", "scan", "unroll")
# How a mixture-of-experts layer computes its experts (models/moe.py): "ragged" = the tokens sorted by expert
# and one grouped matmul (`lax.ragged_dot`: each token computes its k experts only); "dense" = every expert on
# every token, combined with the routing weights (no gather or sort); "auto" = per forward the one the compiled
# costs price cheaper for its token count on the platform (models/moe.py AUTO_DISPATCH; a speed option).
EXPERT_DISPATCHES: tuple[str, ...] = ("ragged", "dense", "auto")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """The mixture-of-experts layers of LLaDA2 (BailingMoeV2): after `first_dense_layers` dense layers, each
  MLP is a sigmoid router choosing `experts_per_token` of `num_experts` SwiGLU experts (group-limited: keep
  the `groups_kept` of `num_groups` contiguous expert groups with the largest sum of their top-2 biased
  scores, then the top experts among those), weighted by their unbiased scores normalised to sum to 1 and
  scaled by `routed_scaling`, plus `num_shared_experts` always-on experts fused into one SwiGLU."""

  num_experts: int
  experts_per_token: int
  expert_mlp_dim: int
  num_shared_experts: int = 0
  num_groups: int = 1
  groups_kept: int = 1
  routed_scaling: float = 1.0
  first_dense_layers: int = 0
  expert_bias: bool = True  # the router's selection bias (kept in float32), used to choose experts only
  dispatch: str = "ragged"  # one of EXPERT_DISPATCHES

  def __post_init__(self):
    for field in ("num_experts", "experts_per_token", "expert_mlp_dim", "num_groups", "groups_kept"):
      value = getattr(self, field)
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"MoEConfig.{field} must be a positive int, got {value!r}")
    for field in ("num_shared_experts", "first_dense_layers"):
      value = getattr(self, field)
      if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"MoEConfig.{field} must be a non-negative int, got {value!r}")
    if self.num_experts % self.num_groups:
      raise ValueError(f"MoEConfig.num_experts ({self.num_experts}) must be a multiple of num_groups "
                       f"({self.num_groups})")
    if self.num_groups > 1 and self.num_experts // self.num_groups < 2:
      raise ValueError(f"MoEConfig: a group's score sums its top-2 experts, so each of the {self.num_groups} "
                       f"groups needs at least 2 of the {self.num_experts} experts")
    if self.groups_kept > self.num_groups:
      raise ValueError(f"MoEConfig.groups_kept ({self.groups_kept}) must be at most num_groups ({self.num_groups})")
    if self.experts_per_token > self.groups_kept * (self.num_experts // self.num_groups):
      raise ValueError(f"MoEConfig.experts_per_token ({self.experts_per_token}) exceeds the experts of the "
                       f"{self.groups_kept} kept groups")
    if self.dispatch not in EXPERT_DISPATCHES:
      raise ValueError(f"MoEConfig.dispatch must be one of {EXPERT_DISPATCHES}, got {self.dispatch!r}")

  @property
  def shared_mlp_dim(self) -> int:
    return self.expert_mlp_dim * self.num_shared_experts


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape and numerics of one pre-norm transformer (LLaDA / Dream / Qwen2-style)."""

  vocab_size: int
  embed_dim: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int
  rope_theta: float = 10_000.0
  norm_eps: float = 1e-5
  qkv_bias: bool = False
  tie_embeddings: bool = False
  # Dream predicts token i from output row i - 1 (row 0 reused for position 0).
  logit_shift: bool = False
  mask_token_id: int = 0
  eos_token_id: int = 1
  pad_token_id: int = 1
  bos_token_id: int | None = None
  # End-of-turn token that also stops chat generation (LLaDA <|eot_id|>, Dream <|im_end|>).
  eot_token_id: int | None = None
  family: Family = "custom"
  dtype: str = "float32"  # activation / compute dtype
  param_dtype: str = "float32"  # storage dtype of the weights
  attention_impl: str = "auto"  # one of ATTENTION_IMPLS; "auto": Pallas on GPU/TPU, the reference on CPU
  remat: bool = False  # rematerialise layer activations in the backward pass (long rows, big models)
  layer_loop: str = "auto"  # one of LAYER_LOOPS: "auto" unrolls the layers of cached decode steps only
  # Positions the model was trained for (config.json's max_sequence_length / max_position_embeddings):
  # decoding refuses rows that would run past them. None: unchecked.
  max_positions: int | None = None
  # How the model was trained to attend (one of ATTENTION_KINDS), so that `decode.generate` itself refuses a
  # method that cannot work with it ('ar' on a masked-diffusion model decodes garbage). Set by every loader
  # (config.json `d2f_attention`, else 'bidirectional' for the released LLaDA / Dream; d2f_model.json) and by the
  # trainer from its objective. None: unknown (a model built in memory), nothing is checked.
  attention_kind: str | None = None
  qk_norm: bool = False  # RMSNorm over head_dim on each query and key head, before RoPE (LLaDA2)
  rotary_dim: int | None = None  # RoPE on the first rotary_dim dims of a head, the rest pass (None: head_dim)
  moe: MoEConfig | None = None  # mixture-of-experts MLPs after moe.first_dense_layers dense ones (LLaDA2)
  # Block-causal attention cuts the prompt in blocks from position 0 (LLaDA2's training) instead of keeping it
  # one bidirectional unit (D2F's student): models/attention.py.
  prompt_blocks: bool = False

  def __post_init__(self):
    for field in ("vocab_size", "embed_dim", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim"):
      value = getattr(self, field)
      if not isinstance(value, int) or value <= 0:
        raise ValueError(f"ModelConfig.{field} must be a positive int, got {value!r}")
    if self.max_positions is not None and (not isinstance(self.max_positions, int) or self.max_positions <= 0):
      raise ValueError(f"ModelConfig.max_positions must be a positive int or None, got {self.max_positions!r}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
    if self.head_dim % 2:
      raise ValueError(f"ModelConfig.head_dim must be even for half-split RoPE, got {self.head_dim}")
    rotary = self.rotary_dim
    if rotary is not None and (not isinstance(rotary, int) or rotary <= 0 or rotary % 2 or rotary > self.head_dim):
      raise ValueError(f"ModelConfig.rotary_dim must be None or an even int in (0, head_dim={self.head_dim}], "
                       f"got {rotary!r}")
    if self.moe is not None and self.moe.first_dense_layers > self.num_layers:
      raise ValueError(f"ModelConfig.moe.first_dense_layers ({self.moe.first_dense_layers}) exceeds num_layers "
                       f"({self.num_layers})")
    for field in ("dtype", "param_dtype"):
      try:
        jnp.dtype(getattr(self, field))
      except TypeError as e:
        raise ValueError(f"ModelConfig.{field}={getattr(self, field)!r} is not a dtype name") from e
    if self.attention_kind is not None and self.attention_kind not in ATTENTION_KINDS:
      raise ValueError(f"ModelConfig.attention_kind must be one of {ATTENTION_KINDS} or None, "
                       f"got {self.attention_kind!r}")
    if self.layer_loop not in LAYER_LOOPS:
      raise ValueError(f"ModelConfig.layer_loop must be one of {LAYER_LOOPS}, got {self.layer_loop!r}")
    if self.attention_impl not in ATTENTION_IMPLS:
      raise ValueError(f"ModelConfig.attention_impl must be one of {ATTENTION_IMPLS}, got {self.attention_impl!r}")

  @property
  def compute_dtype(self):
    return jnp.dtype(self.dtype)

  @property
  def weight_dtype(self):
    return jnp.dtype(self.param_dtype)

  @property
  def group_size(self) -> int:
    """Query heads per KV head (GQA)."""
    return self.num_heads // self.num_kv_heads

  @property
  def dense_layers(self) -> int:
    """Layers with a dense MLP (the `layers` stack); the rest (`moe_layers`) are mixture-of-experts."""
    return self.num_layers if self.moe is None else self.moe.first_dense_layers

  def unrolls_layers(self, cached: bool) -> bool:
    """Whether a forward (`cached`: against a KV cache) runs its layers as a Python loop, not a scan."""
    return self.layer_loop == "unroll" or (self.layer_loop == "auto" and cached)

  def replace(self, **changes) -> "ModelConfig":
    return dataclasses.replace(self, **changes)

  def with_expert_dispatch(self, dispatch: str) -> "ModelConfig":
    """This config with its experts computed by `dispatch` (MoEConfig.dispatch): how, not what, so a
    checkpoint's layout stays valid. Refused on a model without experts, where it would mean nothing."""
    if self.moe is None:
      raise ValueError(f"expert dispatch {dispatch!r} applies to mixture-of-experts models only; this "
                       f"{self.family!r} model has no experts (ModelConfig.moe is None)")
    return self.replace(moe=dataclasses.replace(self.moe, dispatch=dispatch))


LoraTarget = Literal["q", "k", "v", "o", "gate", "up", "down"]
LORA_TARGETS: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """Low-rank adapters on the projections named by `targets` (our names, see LORA_TARGETS).

  The update is `scale * A @ B` with `scale = alpha / rank` (or `alpha / sqrt(rank)` with rsLoRA),
  exactly as PEFT computes it, so adapters convert both ways without rescaling.
  """

  rank: int = 32
  alpha: float = 32.0
  dropout: float = 0.0
  targets: tuple[str, ...] = ("q", "k", "v", "o")
  use_rslora: bool = False

  def __post_init__(self):
    if self.rank <= 0:
      raise ValueError(f"LoraConfig.rank must be positive, got {self.rank}")
    unknown = [t for t in self.targets if t not in LORA_TARGETS]
    if unknown or not self.targets:
      raise ValueError(f"LoraConfig.targets must be a non-empty subset of {LORA_TARGETS}, got {self.targets}")
    if not 0.0 <= self.dropout < 1.0:
      raise ValueError(f"LoraConfig.dropout must be in [0, 1), got {self.dropout}")

  @property
  def scale(self) -> float:
    return self.alpha / (self.rank ** 0.5 if self.use_rslora else self.rank)


# --- presets -----------------------------------------------------------------------------------

LLADA_8B = ModelConfig(
    vocab_size=126464, embed_dim=4096, num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128,
    mlp_dim=12288, rope_theta=500000.0, norm_eps=1e-5, qkv_bias=False, tie_embeddings=False,
    logit_shift=False, mask_token_id=126336, eos_token_id=126081, pad_token_id=126081,
    bos_token_id=126080, eot_token_id=126348, family="llada", dtype="bfloat16", param_dtype="bfloat16",
    max_positions=4096)

DREAM_7B = ModelConfig(
    vocab_size=152064, embed_dim=3584, num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128,
    mlp_dim=18944, rope_theta=1e6, norm_eps=1e-6, qkv_bias=True, tie_embeddings=False,
    logit_shift=True, mask_token_id=151666, eos_token_id=151643, pad_token_id=151643,
    bos_token_id=None, eot_token_id=151645, family="dream", dtype="bfloat16", param_dtype="bfloat16",
    max_positions=131072)

# Tiny variants keep each family's quirks (bias, GQA, shift, norm eps) at test size.
TINY_LLADA = ModelConfig(
    vocab_size=512, embed_dim=64, num_layers=2, num_heads=4, num_kv_heads=4, head_dim=16, mlp_dim=160,
    rope_theta=500000.0, norm_eps=1e-5, qkv_bias=False, logit_shift=False, mask_token_id=500,
    eos_token_id=501, pad_token_id=501, bos_token_id=502, eot_token_id=503, family="llada", max_positions=4096)

TINY_DREAM = ModelConfig(
    vocab_size=512, embed_dim=64, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=16, mlp_dim=160,
    rope_theta=1e6, norm_eps=1e-6, qkv_bias=True, logit_shift=True, mask_token_id=500,
    eos_token_id=501, pad_token_id=501, bos_token_id=None, eot_token_id=503, family="dream",
    max_positions=131072)

# LLaDA2.0 (inclusionAI, BailingMoeV2 layout): block diffusion (block 32) on a sigmoid-routed MoE with one
# shared expert, fused q/k/v with per-head q/k RMSNorm, RoPE on half of each head, GQA 4 KV heads.
_LLADA2_IDS = dict(mask_token_id=156895, eos_token_id=156892, pad_token_id=156892, bos_token_id=None,
                   eot_token_id=None)
LLADA2_MINI = ModelConfig(
    vocab_size=157184, embed_dim=2048, num_layers=20, num_heads=16, num_kv_heads=4, head_dim=128, mlp_dim=5120,
    rope_theta=600000.0, norm_eps=1e-6, family="llada2", dtype="bfloat16", param_dtype="bfloat16",
    max_positions=16384, qk_norm=True, rotary_dim=64, attention_kind="block_causal", prompt_blocks=True,
    **_LLADA2_IDS,
    moe=MoEConfig(num_experts=256, experts_per_token=8, expert_mlp_dim=512, num_shared_experts=1, num_groups=8,
                  groups_kept=4, routed_scaling=2.5, first_dense_layers=1))
LLADA2_FLASH = LLADA2_MINI.replace(
    embed_dim=4096, num_layers=32, num_heads=32, mlp_dim=9216,
    moe=dataclasses.replace(LLADA2_MINI.moe, expert_mlp_dim=1024))
TINY_LLADA2 = ModelConfig(
    vocab_size=512, embed_dim=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=96,
    rope_theta=600000.0, norm_eps=1e-6, family="llada2", qk_norm=True, rotary_dim=8, max_positions=4096,
    prompt_blocks=True,
    mask_token_id=500, eos_token_id=501, pad_token_id=501, bos_token_id=None, eot_token_id=None,
    moe=MoEConfig(num_experts=8, experts_per_token=3, expert_mlp_dim=24, num_shared_experts=1, num_groups=2,
                  groups_kept=1, routed_scaling=2.5, first_dense_layers=1))

PRESETS: dict[str, ModelConfig] = {
    "llada-8b": LLADA_8B, "dream-7b": DREAM_7B, "tiny-llada": TINY_LLADA, "tiny-dream": TINY_DREAM,
    "llada2-mini": LLADA2_MINI, "llada2-flash": LLADA2_FLASH, "tiny-llada2": TINY_LLADA2,
}


def preset(name: str, **overrides) -> ModelConfig:
  """A named preset with optional field overrides, e.g. `preset("tiny-dream", dtype="bfloat16")`."""
  if name not in PRESETS:
    raise KeyError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
  return PRESETS[name].replace(**overrides)
