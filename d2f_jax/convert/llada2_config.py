"""config.json <-> ModelConfig fields for LLaDA2 (model_type "llada2_moe": inclusionAI's LLaDA2.0 / 2.1, the
BailingMoeV2 layout), used by convert/hf_config.py.

Every field the released configs set is read or checked: the routing the remote code runs (sigmoid scores,
the selection bias, group-limited top-k, normalised and scaled weights) is the only one accepted, and a
config asking for another (`score_function` softmax, no expert bias, `norm_topk_prob` false, a
normalised lm_head, rope scaling, biases on the linear layers) is refused by name rather than decoded wrong.
"""

from __future__ import annotations

from typing import Any

from d2f_jax.convert.validate import ConfigError, get_bool, get_float, get_int, get_str
from d2f_jax.models.config import ModelConfig, MoEConfig

MODEL_TYPE = "llada2_moe"
# The released models' special tokens (their generate's defaults; config.json names only pad).
DEFAULT_IDS = dict(mask_token_id=156895, eos_token_id=156892, pad_token_id=156892, bos_token_id=None,
                   eot_token_id=None)


def _refuse(source: str, field: str, value, why: str):
  raise ConfigError(f"{source}: {field}={value!r} is not supported ({why})")


def llada2_fields(hf: dict, source: str) -> dict[str, Any]:
  """ModelConfig fields (shapes, numerics, experts) of a LLaDA2 config.json, every field checked."""
  if get_str(hf, "score_function", source, default="sigmoid") != "sigmoid":
    _refuse(source, "score_function", hf["score_function"], "LLaDA2 routes by sigmoid scores; softmax routing is "
            "another model")
  if not get_bool(hf, "moe_router_enable_expert_bias", source, default=True):
    _refuse(source, "moe_router_enable_expert_bias", False, "the released router chooses with its expert_bias")
  if not get_bool(hf, "norm_topk_prob", source, default=True):
    _refuse(source, "norm_topk_prob", False, "the released router normalises the chosen experts' weights")
  for field, why in (("norm_head", "a normalised lm_head"), ("use_bias", "biases on the dense layers"),
                     ("norm_softmax", "a normalised softmax"), ("use_sliding_window", "sliding-window attention")):
    if get_bool(hf, field, source):
      _refuse(source, field, True, f"{why} is not part of LLaDA2")
  if hf.get("rope_scaling"):
    _refuse(source, "rope_scaling", hf["rope_scaling"], "plain RoPE only")
  if get_str(hf, "hidden_act", source, default="silu") != "silu":
    _refuse(source, "hidden_act", hf["hidden_act"], "SwiGLU with silu only")
  if not get_bool(hf, "use_rmsnorm", source, default=True):
    _refuse(source, "use_rmsnorm", False, "RMSNorm only")
  hidden, heads = get_int(hf, "hidden_size", source), get_int(hf, "num_attention_heads", source)
  head_dim = get_int(hf, "head_dim", source, default=None) or hidden // heads
  factor = get_float(hf, "partial_rotary_factor", source, default=None)
  rotary_dim = int(head_dim * factor) if factor is not None else get_int(hf, "rotary_dim", source, default=head_dim)
  if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
    raise ConfigError(f"{source}: partial_rotary_factor {factor} of head_dim {head_dim} gives rotary dims "
                      f"{rotary_dim}, expected an even number in (0, {head_dim}]")
  layers = get_int(hf, "num_hidden_layers", source)
  experts = get_int(hf, "num_experts", source)
  groups = get_int(hf, "n_group", source, default=1)
  try:
    moe = MoEConfig(num_experts=experts, experts_per_token=get_int(hf, "num_experts_per_tok", source),
                    expert_mlp_dim=get_int(hf, "moe_intermediate_size", source),
                    num_shared_experts=get_int(hf, "num_shared_experts", source, default=0, minimum=0),
                    num_groups=groups, groups_kept=get_int(hf, "topk_group", source, default=groups),
                    routed_scaling=get_float(hf, "routed_scaling_factor", source, default=1.0),
                    first_dense_layers=min(layers, get_int(hf, "first_k_dense_replace", source, default=0, minimum=0)))
  except ValueError as e:
    raise ConfigError(f"{source}: the experts' fields do not fit together: {e}") from e
  return dict(embed_dim=hidden, num_layers=layers, num_heads=heads,
              num_kv_heads=get_int(hf, "num_key_value_heads", source, default=heads), head_dim=head_dim,
              mlp_dim=get_int(hf, "intermediate_size", source), rope_theta=get_float(hf, "rope_theta", source),
              norm_eps=get_float(hf, "rms_norm_eps", source), qkv_bias=get_bool(hf, "use_qkv_bias", source),
              tie_embeddings=get_bool(hf, "tie_word_embeddings", source), logit_shift=False,
              max_positions=get_int(hf, "max_position_embeddings", source, default=None),
              qk_norm=get_bool(hf, "use_qk_norm", source, default=True),
              rotary_dim=None if rotary_dim == head_dim else rotary_dim, moe=moe, prompt_blocks=True)


def llada2_json(config: ModelConfig, dtype: str, ids: dict) -> dict[str, Any]:
  """A config.json in LLaDA2's own format (the released field names and fixed values)."""
  moe = config.moe
  if moe is None or not moe.expert_bias or config.logit_shift:
    raise ConfigError("LLaDA2 has mixture-of-experts MLPs routed with an expert bias and unshifted logits; "
                      "ModelConfig.moe (expert_bias) must be set and logit_shift False for family 'llada2'")
  rotary_dim = config.rotary_dim or config.head_dim
  return {
      "architectures": ["LLaDA2MoeModelLM"],
      "auto_map": {"AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
                   "AutoModel": "modeling_llada2_moe.LLaDA2MoeModel",
                   "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM"},
      "model_type": MODEL_TYPE, "attention_dropout": 0.0, "embedding_dropout": 0.0, "output_dropout": 0.0,
      "first_k_dense_replace": moe.first_dense_layers, "head_dim": config.head_dim, "hidden_act": "silu",
      "hidden_size": config.embed_dim, "initializer_range": 0.02, "intermediate_size": config.mlp_dim,
      "max_position_embeddings": config.max_positions or 16384, "max_window_layers": config.num_layers,
      "moe_intermediate_size": moe.expert_mlp_dim, "moe_router_enable_expert_bias": True, "n_group": moe.num_groups,
      "norm_head": False, "norm_softmax": False, "norm_topk_prob": True,
      "num_attention_heads": config.num_heads, "num_experts": moe.num_experts,
      "num_experts_per_tok": moe.experts_per_token, "num_hidden_layers": config.num_layers,
      "num_key_value_heads": config.num_kv_heads, "num_shared_experts": moe.num_shared_experts or None,
      "output_router_logits": False, "partial_rotary_factor": rotary_dim / config.head_dim,
      "rms_norm_eps": config.norm_eps, "rope_scaling": None, "rope_theta": config.rope_theta,
      "rotary_dim": rotary_dim, "routed_scaling_factor": moe.routed_scaling, "router_dtype": "fp32",
      "score_function": "sigmoid", "tie_word_embeddings": config.tie_embeddings, "topk_group": moe.groups_kept,
      "torch_dtype": dtype, "use_bias": False, "use_cache": False, "use_qk_norm": config.qk_norm,
      "use_qkv_bias": config.qkv_bias, "use_rmsnorm": True, "use_sliding_window": False,
      "vocab_size": config.vocab_size, **ids,
  }
