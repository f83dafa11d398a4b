"""config.json <-> ModelConfig for LLaDA (model_type "llada"), Dream ("Dream") and LLaDA2 ("llada2_moe", whose
fields live in convert/llada2_config.py).

Shape fields are required (a missing one is an error naming it and the file); token ids fall back to the
released models' values (D2F_SPEC section 1) when a config omits them, and must then lie in the vocabulary.
Every field is type-checked through convert/validate.py, so a bad value names the file and the field.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from d2f_jax.convert import llada2_config
from d2f_jax.convert.validate import (ConfigError, build_model_config, check_token_ids, get_bool, get_float, get_int,
                                      get_str, read_json_object, require_object, token_id)
from d2f_jax.models.config import ATTENTION_KINDS, ModelConfig

# config.json model_type (lower-cased) -> family
MODEL_TYPES = {"llada": "llada", "dream": "dream", llada2_config.MODEL_TYPE: "llada2"}
TORCH_DTYPES = ("float32", "bfloat16", "float16")

# Released models' special tokens, used when config.json does not name them.
DEFAULT_IDS = {
    "llada": dict(mask_token_id=126336, eos_token_id=126081, pad_token_id=126081, bos_token_id=126080,
                  eot_token_id=126348),
    "dream": dict(mask_token_id=151666, eos_token_id=151643, pad_token_id=151643, bos_token_id=None,
                  eot_token_id=151645),
    "llada2": llada2_config.DEFAULT_IDS,
}

__all__ = ["ConfigError", "read_hf_config", "config_from_hf", "hf_config_from_model", "declared_dtype",
           "check_same_shapes", "family_of"]


def read_hf_config(hf_dir: str) -> tuple[ModelConfig, dict]:
  """(ModelConfig, raw config.json dict) of a Hugging Face model directory."""
  path = os.path.join(os.fspath(hf_dir), "config.json")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{hf_dir!r} has no config.json")
  raw = read_json_object(path)
  return config_from_hf(raw, source=path), raw


def family_of(hf: dict, source: str = "config.json") -> str:
  model_type = hf.get("model_type")
  if model_type is None:
    raise ConfigError(f"{source}: missing field 'model_type' (expected one of {sorted(MODEL_TYPES)})")
  family = MODEL_TYPES.get(str(model_type).lower())
  if family is None:
    raise ConfigError(f"{source}: unknown model_type {model_type!r}; known: 'llada' (LLaDA), 'Dream' (Dream), "
                      f"'{llada2_config.MODEL_TYPE}' (LLaDA2)")
  return family


def _token_ids(hf: dict, family: str, vocab_size: int, source: str) -> tuple[dict, tuple[str, ...]]:
  """(ids from config.json, else the released model's; fields that took a default). An optional default
  outside the vocabulary becomes None; a required one is checked later (check_token_ids)."""
  ids = dict(DEFAULT_IDS[family])
  for field in ("bos_token_id", "eot_token_id"):
    if ids[field] is not None and ids[field] >= vocab_size:
      ids[field] = None
  defaults = []
  for field in ("mask_token_id", "eos_token_id", "pad_token_id", "bos_token_id", "eot_token_id"):
    value = token_id(hf.get(field), field, source)
    if value is not None:
      ids[field] = value
    elif ids[field] is not None:
      defaults.append(field)
  return ids, tuple(defaults)


def declared_dtype(hf: dict, source: str = "config.json") -> str | None:
  """config.json's `torch_dtype` (or `dtype`), checked; None when it names none."""
  field = "torch_dtype" if hf.get("torch_dtype") is not None else "dtype"
  return get_str(hf, field, source, default=None, choices=TORCH_DTYPES)


def _dtype(hf: dict, source: str) -> str:
  return declared_dtype(hf, source) or "float32"


def _unsupported(source: str, field: str, value, why: str):
  raise ConfigError(f"{source}: {field}={value!r} is not supported ({why})")


ATTENTION_KEY = "d2f_attention"  # config.json key this project writes: how the model was trained to attend


def attention_of(hf: dict, source: str = "config.json") -> str:
  """config.json's `d2f_attention` (written by the trainer's exports), else how the released models were
  trained: LLaDA and Dream bidirectional, LLaDA2 block-causal (block diffusion)."""
  released = "block_causal" if str(hf.get("model_type")).lower() == llada2_config.MODEL_TYPE else "bidirectional"
  return get_str(hf, ATTENTION_KEY, source, default=released, choices=ATTENTION_KINDS)


def _finish(source: str, family: str, vocab: int, hf: dict, **fields) -> ModelConfig:
  ids, defaults = _token_ids(hf, family, vocab, source)
  dtype = _dtype(hf, source)
  config = build_model_config(source, vocab_size=vocab, family=family, dtype=dtype, param_dtype=dtype, **ids,
                              attention_kind=attention_of(hf, source), **fields)
  return check_token_ids(config, source, defaults)


def _llada(hf: dict, source: str) -> ModelConfig:
  if get_str(hf, "block_type", source, default="llama") != "llama":
    _unsupported(source, "block_type", hf["block_type"], "only the 'llama' block with separate q/k/v/ff_proj/up_proj")
  if get_bool(hf, "include_bias", source):
    _unsupported(source, "include_bias", True, "LLaDA's released models have no linear biases")
  if get_bool(hf, "alibi", source) or get_bool(hf, "rope", source, default=True) is False:
    _unsupported(source, "rope", hf.get("rope"), "position encoding must be RoPE")
  if get_str(hf, "layer_norm_type", source, default="rms") != "rms":
    _unsupported(source, "layer_norm_type", hf["layer_norm_type"], "only RMSNorm")
  d_model, n_heads = get_int(hf, "d_model", source), get_int(hf, "n_heads", source)
  if d_model % n_heads:
    raise ConfigError(f"{source}: d_model {d_model} is not a multiple of n_heads {n_heads}")
  n_kv = get_int(hf, "n_kv_heads", source, default=None)
  if n_kv is None:
    n_kv = 1 if get_bool(hf, "multi_query_attention", source) else n_heads
  mlp = get_int(hf, "mlp_hidden_size", source, default=None)
  if mlp is None:
    mlp = get_int(hf, "mlp_ratio", source) * d_model
  vocab = get_int(hf, "vocab_size", source)
  rows = max(vocab, get_int(hf, "embedding_size", source, default=vocab))
  return _finish(
      source, "llada", rows, hf, embed_dim=d_model, num_layers=get_int(hf, "n_layers", source),
      num_heads=n_heads, num_kv_heads=n_kv, head_dim=d_model // n_heads, mlp_dim=mlp,
      rope_theta=get_float(hf, "rope_theta", source), norm_eps=get_float(hf, "rms_norm_eps", source),
      qkv_bias=get_bool(hf, "include_qkv_bias", source), tie_embeddings=get_bool(hf, "weight_tying", source),
      logit_shift=False, max_positions=get_int(hf, "max_sequence_length", source, default=None))


def _dream(hf: dict, source: str) -> ModelConfig:
  if hf.get("rope_scaling"):
    _unsupported(source, "rope_scaling", hf["rope_scaling"], "plain RoPE only")
  if get_str(hf, "hidden_act", source, default="silu") != "silu":
    _unsupported(source, "hidden_act", hf["hidden_act"], "SwiGLU with silu only")
  hidden, heads = get_int(hf, "hidden_size", source), get_int(hf, "num_attention_heads", source)
  head_dim = get_int(hf, "head_dim", source, default=None)
  if head_dim is None:
    if hidden % heads:
      raise ConfigError(f"{source}: hidden_size {hidden} is not a multiple of num_attention_heads {heads} and "
                        "no head_dim is given")
    head_dim = hidden // heads
  vocab = get_int(hf, "vocab_size", source)
  return _finish(
      source, "dream", vocab, hf, embed_dim=hidden, num_layers=get_int(hf, "num_hidden_layers", source),
      num_heads=heads, num_kv_heads=get_int(hf, "num_key_value_heads", source, default=heads), head_dim=head_dim,
      mlp_dim=get_int(hf, "intermediate_size", source), rope_theta=get_float(hf, "rope_theta", source),
      norm_eps=get_float(hf, "rms_norm_eps", source), qkv_bias=True,
      tie_embeddings=get_bool(hf, "tie_word_embeddings", source), logit_shift=True,
      max_positions=get_int(hf, "max_position_embeddings", source, default=None))


def config_from_hf(hf: Any, *, source: str = "config.json") -> ModelConfig:
  """ModelConfig of a parsed config.json; `source` names the file in errors."""
  hf = require_object(hf, source)
  family = family_of(hf, source)
  if family == "llada2":
    return _finish(source, family, get_int(hf, "vocab_size", source), hf, **llada2_config.llada2_fields(hf, source))
  return _llada(hf, source) if family == "llada" else _dream(hf, source)


def hf_config_from_model(config: ModelConfig, dtype: str | None = None) -> dict[str, Any]:
  """A config.json in the family's own format (the real models' field names and fixed values)."""
  dtype = dtype if dtype is not None else config.param_dtype
  ids = {"mask_token_id": config.mask_token_id, "eos_token_id": config.eos_token_id,
         "pad_token_id": config.pad_token_id}
  if config.attention_kind is not None:
    ids[ATTENTION_KEY] = config.attention_kind
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
        "max_sequence_length": config.max_positions or 4096, "mlp_hidden_size": config.mlp_dim, "mlp_ratio": 4,
        "model_type": "llada",
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
        "intermediate_size": config.mlp_dim, "max_position_embeddings": config.max_positions or 131072,
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
  if config.family == "llada2":
    return llada2_config.llada2_json(config, dtype, {**ids, "bos_token_id": config.bos_token_id})
  raise ConfigError(f"ModelConfig.family must be 'llada', 'dream' or 'llada2' to write a Hugging Face config, got "
                    f"{config.family!r}")


SHAPE_FIELDS = ("vocab_size", "embed_dim", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim",
                "qkv_bias", "tie_embeddings", "family", "qk_norm", "rotary_dim", "moe")


def check_same_shapes(config: ModelConfig, hf: dict, source: str = "config.json") -> None:
  """Refuse to pair parameters with a config.json that describes a different layout."""
  other = config_from_hf(hf, source=source)

  def shape(c: ModelConfig, field: str):  # how the experts are computed is no part of the layout
    value = getattr(c, field)
    return dataclasses.replace(value, dispatch="ragged") if field == "moe" and value is not None else value
  diff = {f: (shape(config, f), shape(other, f)) for f in SHAPE_FIELDS if shape(config, f) != shape(other, f)}
  if diff:
    raise ConfigError(f"{source} does not describe these parameters: " +
                      ", ".join(f"{f} params={a!r} config.json={b!r}" for f, (a, b) in diff.items()))
