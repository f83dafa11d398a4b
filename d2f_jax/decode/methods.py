"""The decoding methods, and which model each can decode: refused by name before anything compiles."""

from __future__ import annotations

import json
import os
from typing import Literal

from d2f_jax.convert.hf_config import ATTENTION_KEY  # config.json: how a model was trained to attend
from d2f_jax.models import ModelConfig

Method = Literal["d2f", "threshold", "vanilla", "dream_vanilla", "llada2", "ar"]
METHODS: tuple[str, ...] = ("d2f", "threshold", "vanilla", "dream_vanilla", "llada2", "ar")
DIFFUSION_METHODS: tuple[str, ...] = ("d2f", "threshold", "vanilla", "dream_vanilla", "llada2")


def model_attention(model) -> str | None:
  """How a loaded model attends: its ModelConfig.attention_kind (every loader sets it), else its directory's
  config.json: the ATTENTION_KEY written by the trainer glue, else 'bidirectional' for the LLaDA / Dream
  families (the released models are); None when unknown (a model built in memory)."""
  if getattr(model.config, "attention_kind", None) is not None:
    return model.config.attention_kind
  source = getattr(model, "source", "") or ""
  path = os.path.join(source, "config.json")
  if not source or not os.path.isfile(path):
    return None
  with open(path) as f:
    hf = json.load(f)
  if hf.get(ATTENTION_KEY) is not None:
    return str(hf[ATTENTION_KEY])
  return "bidirectional" if str(hf.get("model_type", "")).lower() in ("llada", "dream") else None


def check_method_fits(model: ModelConfig, config, attention: str | None = None) -> None:
  """Refuse a decoding method that cannot work with the model, instead of decoding garbage.

  The diffusion methods need a model trained to fill in mask tokens (bidirectional or block-causal) with a
  mask id in its vocabulary; 'ar' needs a causal model. attention: 'causal', 'bidirectional',
  'block_causal' or None (unknown: only the mask id is checked), e.g. from `model_attention`.
  """
  if config.method in DIFFUSION_METHODS:
    if not 0 <= model.mask_token_id < model.vocab_size:
      raise ValueError(f"DecodeConfig.method={config.method!r} needs a mask token, but the model's mask_token_id "
                       f"{model.mask_token_id} is outside its vocabulary of {model.vocab_size}")
    if attention == "causal":
      raise ValueError(f"DecodeConfig.method={config.method!r} needs a masked-diffusion (bidirectional) model, "
                       f"but this model was trained causally (ModelConfig.attention_kind='causal', from config.json "
                       f"{ATTENTION_KEY} or d2f_model.json); decode it with method='ar'")
  elif config.method == "ar" and attention is not None and attention != "causal":
    raise ValueError(f"DecodeConfig.method='ar' needs a causal model, but this model attends "
                     f"{attention.replace('_', '-')} (ModelConfig.attention_kind={attention!r}: config.json "
                     f"{ATTENTION_KEY}, d2f_model.json, or a LLaDA / Dream model); "
                     "use a diffusion method (d2f, threshold, vanilla, dream_vanilla)")
