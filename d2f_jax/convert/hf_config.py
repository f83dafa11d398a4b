"""config.json <-> ModelConfig for LLaDA (model_type "llada") and Dream (model_type "Dream").

Shape fields are required (a missing one is an error naming it and the file); token ids fall back to the
released models' values (D2F_SPEC section 1) when a config omits them.
"""

from __future__ import annotations

import json
import os
from typing import Any

from d2f_jax.models.config import ModelConfig

MODEL_TYPES = {"llada": "llada", "dream": "dream"}  # config.json model_type (lower-cased) -> family

# Released models' special tokens, used when config.json does not name them.
DEFAULT_IDS = {
    "llada": dict(mask_token_id=126336, eos_token_id=126081, pad_token_id=126081, bos_token_id=126080,
                  eot_token_id=126348),
    "dream": dict(mask_token_id=151666, eos_token_id=151643, pad_token_id=151643, bos_token_id=None,
                  eot_token_id=151645),
}


class ConfigError(ValueError):
  """A config.json this converter cannot turn into a ModelConfig."""


def read_hf_config(hf_dir: str) -> tuple[ModelConfig, dict]:
  """(ModelConfig, raw config.json dict) of a Hugging Face model directory."""
  path = os.path.join(os.fspath(hf_dir), "config.json")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{hf_dir!r} has no config.json")
  try:
    with open(path) as f:
      raw = json.load(f)
  except json.JSONDecodeError as e:
    raise ConfigError(f"{path}: not valid JSON ({e})") from e
  return config_from_hf(raw, source=path), raw


def family_of(hf: dict, source: str = "config.json") -> str:
  model_type = hf.get("model_type")
  if model_type is None:
    raise ConfigError(f"{source}: missing field 'model_type' (expected one of {sorted(MODEL_TYPES)})")
  family = MODEL_TYPES.get(str(model_type).lower())
  if family is None:
    raise ConfigError(f"{source}: unknown model_type {model_type!r}; known: 'llada' (LLaDA), 'Dream' (Dream)")
  return family


def _need(hf: dict, field: str, source: str):
  if hf.get(field) is None:
    raise ConfigError(f"{source}: missing field {field!r} (model_type {hf.get('model_type')!r})")
  return hf[field]


def _int(hf: dict, field: str, source: str) -> int:
  value = _need(hf, field, source)
  if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
    raise ConfigError(f"{source}: field {field!r} must be a positive integer, got {value!r}")
  return value


def _token_ids(hf: dict, family: str, vocab_size: int) -> dict:
  """Ids from config.json, else the released model's; an optional default outside the vocab becomes None."""
  ids = dict(DEFAULT_IDS[family])
  for field in ("bos_token_id", "eot_token_id"):
    if ids[field] is not None and ids[field] >= vocab_size:
      ids[field] = None
  for field in ("mask_token_id", "eos_token_id", "pad_token_id", "bos_token_id", "eot_token_id"):
    value = hf.get(field)
    if isinstance(value, list):  # some configs list several eos ids; the first is the canonical one
      value = value[0] if value else None
    if value is not None:
      ids[field] = int(value)
  return ids


def _dtype(hf: dict) -> str:
  name = hf.get("torch_dtype") or hf.get("dtype")
  return name if name in ("float32", "bfloat16", "float16") else "float32"


def _unsupported(source: str, field: str, value, why: str):
  raise ConfigError(f"{source}: {field}={value!r} is not supported ({why})")


def _llada(hf: dict, source: str) -> ModelConfig:
  if hf.get("block_type", "llama") != "llama":
    _unsupported(source, "block_type", hf["block_type"], "only the 'llama' block with separate q/k/v/ff_proj/up_proj")
  if hf.get("include_bias"):
    _unsupported(source, "include_bias", True, "LLaDA's released models have no linear biases")
  if hf.get("alibi") or hf.get("rope") is False:
    _unsupported(source, "rope", hf.get("rope"), "position encoding must be RoPE")
  if hf.get("layer_norm_type", "rms") != "rms":
    _unsupported(source, "layer_norm_type", hf["layer_norm_type"], "only RMSNorm")
  d_model, n_heads = _int(hf, "d_model", source), _int(hf, "n_heads", source)
  if d_model % n_heads:
    raise ConfigError(f"{source}: d_model {d_model} is not a multiple of n_heads {n_heads}")
  n_kv = hf.get("n_kv_heads")
  if n_kv is None:
    n_kv = 1 if hf.get("multi_query_attention") else n_heads
  mlp = hf.get("mlp_hidden_size")
  if mlp is None:
    mlp = _int(hf, "mlp_ratio", source) * d_model
  vocab = _int(hf, "vocab_size", source)
  rows = max(vocab, hf.get("embedding_size") or vocab)
  return ModelConfig(
      vocab_size=rows, embed_dim=d_model, num_layers=_int(hf, "n_layers", source),
      num_heads=n_heads, num_kv_heads=int(n_kv), head_dim=d_model // n_heads, mlp_dim=int(mlp),
      rope_theta=float(_need(hf, "rope_theta", source)), norm_eps=float(_need(hf, "rms_norm_eps", source)),
      qkv_bias=bool(hf.get("include_qkv_bias", False)), tie_embeddings=bool(hf.get("weight_tying", False)),
      logit_shift=False, family="llada", dtype=_dtype(hf), param_dtype=_dtype(hf), **_token_ids(hf, "llada", rows))


def _dream(hf: dict, source: str) -> ModelConfig:
  if hf.get("rope_scaling"):
    _unsupported(source, "rope_scaling", hf["rope_scaling"], "plain RoPE only")
  if hf.get("hidden_act", "silu") != "silu":
    _unsupported(source, "hidden_act", hf["hidden_act"], "SwiGLU with silu only")
  hidden, heads = _int(hf, "hidden_size", source), _int(hf, "num_attention_heads", source)
  head_dim = hf.get("head_dim")
  if head_dim is None:
    if hidden % heads:
      raise ConfigError(f"{source}: hidden_size {hidden} is not a multiple of num_attention_heads {heads} and "
                        "no head_dim is given")
    head_dim = hidden // heads
  vocab = _int(hf, "vocab_size", source)
  return ModelConfig(
      vocab_size=vocab, embed_dim=hidden, num_layers=_int(hf, "num_hidden_layers", source),
      num_heads=heads, num_kv_heads=int(hf.get("num_key_value_heads") or heads), head_dim=int(head_dim),
      mlp_dim=_int(hf, "intermediate_size", source), rope_theta=float(_need(hf, "rope_theta", source)),
      norm_eps=float(_need(hf, "rms_norm_eps", source)), qkv_bias=True,
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)), logit_shift=True, family="dream",
      dtype=_dtype(hf), param_dtype=_dtype(hf), **_token_ids(hf, "dream", vocab))


def config_from_hf(hf: dict, *, source: str = "config.json") -> ModelConfig:
  """ModelConfig of a parsed config.json; `source` names the file in errors."""
  family = family_of(hf, source)
  return _llada(hf, source) if family == "llada" else _dream(hf, source)


def hf_config_from_model(config: ModelConfig, dtype: str | None = None) -> dict[str, Any]:
  """A config.json in the family's own format (the real models' field names and fixed values)."""
  dtype = dtype if dtype is not None else config.param_dtype
  ids = {"mask_token_id": config.mask_token_id, "eos_token_id": config.eos_token_id,
         "pad_token_id": config.pad_token_id}
  if config.family in DEFAULT_IDS and config.eot_token_id != DEFAULT_IDS[config.family]["eot_token_id"]:
    ids["eot_token_id"] = config.eot_token_id  # not a field of the released configs; only when it differs
  if config.family == "llada":
    if config.head_dim * config.num_heads != config.embed_dim:
      raise ConfigError(f"LLaDA needs head_dim * num_heads == embed_dim, got {config.head_dim} * "
                        f"{config.num_heads} != {config.embed_dim}")
    if config.logit_shift:
      raise ConfigError("LLaDA does not shift logits; ModelConfig.logit_shift must be False for family 'llada'")
    return {
        "activation_type": "silu", "alibi": False,
        "architectures": ["LLaDAModelLM"],
        "auto_map": {"AutoConfig": "configuration_llada.LLaDAConfig",
                     "AutoModel": "modeling_llada.LLaDAModelLM",
                     "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM"},
        "attention_dropout": 0.0, "attention_layer_norm": False, "block_type": "llama",
        "bias_for_layer_norm": False, "d_model": config.embed_dim, "embedding_dropout": 0.0,
        "embedding_size": config.vocab_size, "include_bias": False, "include_qkv_bias": config.qkv_bias,
        "input_emb_norm": False, "layer_norm_type": "rms", "layer_norm_with_affine": True,
        "max_sequence_length": 4096, "mlp_hidden_size": config.mlp_dim, "mlp_ratio": 4, "model_type": "llada",
        "multi_query_attention": None, "n_heads": config.num_heads, "n_kv_heads": config.num_kv_heads,
        "n_layers": config.num_layers, "precision": "amp_bf16", "residual_dropout": 0.0,
        "rms_norm_eps": config.norm_eps, "rope": True, "rope_full_precision": True,
        "rope_theta": config.rope_theta, "scale_logits": False, "torch_dtype": dtype, "use_cache": False,
        "vocab_size": config.vocab_size, "weight_tying": config.tie_embeddings,
        **ids, "bos_token_id": config.bos_token_id,
    }
  if config.family == "dream":
    if not config.qkv_bias or not config.logit_shift:
      raise ConfigError("Dream has q/k/v biases and shifted logits; ModelConfig.qkv_bias and logit_shift must be "
                        "True for family 'dream'")
    hf = {
        "architectures": ["DreamModel"],
        "attention_dropout": 0.0,
        "auto_map": {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"},
        "hidden_act": "silu", "hidden_size": config.embed_dim, "initializer_range": 0.02,
        "intermediate_size": config.mlp_dim, "max_position_embeddings": 131072,
        "max_window_layers": config.num_layers, "model_type": "Dream",
        "num_attention_heads": config.num_heads, "num_hidden_layers": config.num_layers,
        "num_key_value_heads": config.num_kv_heads, "rms_norm_eps": config.norm_eps, "rope_scaling": None,
        "rope_theta": config.rope_theta, "sliding_window": None, "tie_word_embeddings": config.tie_embeddings,
        "torch_dtype": dtype, "use_cache": True, "use_sliding_window": False, "vocab_size": config.vocab_size,
        **ids, "bos_token_id": config.bos_token_id,
    }
    if config.head_dim * config.num_heads != config.embed_dim:
      hf["head_dim"] = config.head_dim
    return hf
  raise ConfigError(f"ModelConfig.family must be 'llada' or 'dream' to write a Hugging Face config, got "
                    f"{config.family!r}")


SHAPE_FIELDS = ("vocab_size", "embed_dim", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim",
                "qkv_bias", "tie_embeddings", "family")


def check_same_shapes(config: ModelConfig, hf: dict, source: str = "config.json") -> None:
  """Refuse to pair parameters with a config.json that describes a different layout."""
  other = config_from_hf(hf, source=source)
  diff = {f: (getattr(config, f), getattr(other, f)) for f in SHAPE_FIELDS if getattr(config, f) != getattr(other, f)}
  if diff:
    raise ConfigError(f"{source} does not describe these parameters: " +
                      ", ".join(f"{f} params={a!r} config.json={b!r}" for f, (a, b) in diff.items()))
