"""Hugging Face LLaDA / Dream checkpoints and PEFT LoRA adapters <-> d2f_jax parameters and directories.

  load_hf_params(hf_dir) -> (config, params)            stream an HF checkpoint into our layout
  read_peft_adapter(dir, config) -> (lora_cfg, lora)    PEFT adapter into our LoRA layout
  merge_lora(params, lora_cfg, lora, config)            W + scale * a @ b
  save_converted / restore_converted                    orbax directory with config + tokenizer
  export_hf / export_peft_adapter                       back to Hugging Face / PEFT files
  convert_hf_dir / export_converted                     the CLI's two directions
  resolve_model_dir / read_model_config / load_params   a path or Hub id -> directory -> config / weights
"""

from d2f_jax.convert.checkpoint import (is_converted_dir, read_converted_meta, restore_converted, save_converted)
from d2f_jax.convert.hf_config import config_from_hf, hf_config_from_model, read_hf_config
from d2f_jax.convert.hf_export import export_hf
from d2f_jax.convert.hf_import import CheckpointError, load_hf_params
from d2f_jax.convert.lora import (AdapterError, export_peft_adapter, merge_lora, read_peft_adapter, split_lora,
                                  with_lora)
from d2f_jax.convert.mapping import expected_tensors, lora_shapes, param_shapes
from d2f_jax.convert.pipeline import convert_hf_dir, export_converted
from d2f_jax.convert.source import checkpoint_kind, load_params, read_model_config, resolve_model_dir

__all__ = [
    "is_converted_dir", "read_converted_meta", "restore_converted", "save_converted", "config_from_hf",
    "hf_config_from_model", "read_hf_config", "export_hf", "CheckpointError", "load_hf_params", "AdapterError",
    "export_peft_adapter", "merge_lora", "read_peft_adapter", "split_lora", "with_lora", "expected_tensors",
    "lora_shapes", "param_shapes", "convert_hf_dir", "export_converted", "checkpoint_kind", "load_params",
    "read_model_config", "resolve_model_dir",
]
