"""The transformer family: config, layers, attention patterns, KV cache and jitted entry points."""

from d2f_jax.kernels.reference import PAD_ID, attention_reference
from d2f_jax.models.abstract import abstract_model, with_shardings
from d2f_jax.models.attention import ATTENTION_MODES, attention_ids
from d2f_jax.models.config import (DREAM_7B, LLADA_8B, PRESETS, TINY_DREAM, TINY_LLADA, LoraConfig,
                                   ModelConfig, preset)
from d2f_jax.models.functional import forward, logits_for_mode
from d2f_jax.models.kv_cache import KVCache
from d2f_jax.models.layers import positions_from_mask
from d2f_jax.models.transformer import PROJECTIONS, Transformer, align_logits, proj_shape

__all__ = [
    "abstract_model", "with_shardings", "ATTENTION_MODES", "PAD_ID", "attention_ids", "attention_reference",
    "DREAM_7B", "LLADA_8B", "PRESETS",
    "TINY_DREAM", "TINY_LLADA", "LoraConfig", "ModelConfig", "preset", "forward", "logits_for_mode", "KVCache",
    "positions_from_mask", "PROJECTIONS", "Transformer", "align_logits", "proj_shape",
]
