"""Tiny random checkpoints in the exact released formats, for tests and benchmarks.

`write_hf_checkpoint` writes what a LLaDA / Dream Hugging Face repo holds (config.json with the real field
names, tensors with the real names in [out, in] layout, optional shards + index, a loadable tokenizer);
`write_peft_adapter` writes what PEFT's `save_pretrained` writes. Values are deterministic per
(seed, tensor name), so sharding or dtype changes never change which numbers a tensor gets.
"""

from __future__ import annotations

import json
import os
import zlib

import numpy as np

from d2f_jax.convert import mapping
from d2f_jax.convert.hf_config import hf_config_from_model
from d2f_jax.convert.lora import peft_adapter_config, peft_names
from d2f_jax.convert.safetensors import TensorSpec, save_file, write_sharded
from d2f_jax.convert.util import as_numpy_dtype
from d2f_jax.models.config import LoraConfig, ModelConfig

_CHUNK = 1 << 22  # elements generated at a time


def random_tensor(name: str, shape, dtype, seed: int) -> np.ndarray:
  """Norm weights ~ 1 + 0.1 N, embeddings ~ 0.1 N, other weights and biases ~ 0.05 N."""
  rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
  is_norm = "norm" in name or "ln_f" in name
  mean, std = (1.0, 0.1) if is_norm else (0.0, 0.1 if ("wte" in name or "embed" in name) else 0.05)
  out = np.empty(shape, as_numpy_dtype(dtype))
  flat = out.reshape(-1)
  for lo in range(0, flat.size, _CHUNK):
    hi = min(flat.size, lo + _CHUNK)
    flat[lo:hi] = rng.standard_normal(hi - lo, dtype=np.float32) * np.float32(std) + np.float32(mean)
  return out


def hf_tensor_specs(config: ModelConfig, dtype) -> list[TensorSpec]:
  dtype = as_numpy_dtype(dtype)
  return [TensorSpec(e.hf, dtype, e.hf_shape) for e in mapping.expected_tensors(config).values()]


def write_hf_checkpoint(out_dir, config: ModelConfig, seed: int = 0, dtype: str = "float32", shards: int = 1, *,
                        fmt: str = "safetensors", tokenizer: bool = True, hf_config_overrides: dict | None = None,
                        progress=None) -> str:
  """A random HF checkpoint of `config` in `out_dir` (created): config.json, weights, tokenizer files.

  fmt: 'safetensors' or 'pickle' (pytorch_model.bin, for the refuse-pickle path). shards > 1 writes
  `model-0000k-of-0000n.safetensors` + `model.safetensors.index.json`. `progress(spec)` is called per tensor.
  """
  out_dir = os.fspath(out_dir)
  os.makedirs(out_dir, exist_ok=True)
  hf = hf_config_from_model(config, dtype=as_numpy_dtype(dtype).name)
  hf.update(hf_config_overrides or {})
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(hf, f, indent=2)
    f.write("\n")
  specs = hf_tensor_specs(config, dtype)
  produce = lambda s: random_tensor(s.name, s.shape, s.dtype, seed)  # noqa: E731
  if fmt == "safetensors":
    write_sharded(out_dir, specs, produce, num_shards=shards, metadata={"format": "pt"}, on_written=progress)
  elif fmt == "pickle":
    _write_pickle(out_dir, specs, produce)
  else:
    raise ValueError(f"fmt must be 'safetensors' or 'pickle', got {fmt!r}")
  if tokenizer:
    write_tokenizer(out_dir, config)
  return out_dir


def _write_pickle(out_dir: str, specs, produce) -> None:
  import torch
  state = {}
  for spec in specs:
    array = produce(spec)
    if array.dtype == as_numpy_dtype("bfloat16"):
      state[spec.name] = torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    else:
      state[spec.name] = torch.from_numpy(array)
  torch.save(state, os.path.join(out_dir, "pytorch_model.bin"))


def write_peft_adapter(out_dir, config: ModelConfig, lora_cfg: LoraConfig, seed: int = 0, *, dtype: str = "float32",
                       base_model_name_or_path: str | None = None) -> str:
  """A random PEFT LoRA adapter for a base of `config`: adapter_config.json + adapter_model.safetensors,
  A [r, in] ~ 0.05 N and B [out, r] ~ 0.05 N (nonzero, unlike a fresh PEFT init)."""
  out_dir = os.fspath(out_dir)
  os.makedirs(out_dir, exist_ok=True)
  base = mapping.expected_tensors(config)
  tensors = {}
  for i in range(config.num_layers):
    for t in lora_cfg.targets:
      a_name, b_name, base_name = peft_names(config.family, t, i)
      out_features, in_features = base[base_name].hf_shape
      tensors[a_name] = random_tensor(a_name, (lora_cfg.rank, in_features), dtype, seed)
      tensors[b_name] = random_tensor(b_name, (out_features, lora_cfg.rank), dtype, seed)
  save_file(os.path.join(out_dir, "adapter_model.safetensors"), tensors, metadata={"format": "pt"})
  adapter_cfg = peft_adapter_config(config, lora_cfg, base_model_name_or_path)
  with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
    json.dump(adapter_cfg, f, indent=2)
    f.write("\n")
  return out_dir


# --- tokenizer -----------------------------------------------------------------------------------

_SPECIAL_NAMES = {
    "llada": {"mask_token_id": "<|mdm_mask|>", "eos_token_id": "<|endoftext|>", "bos_token_id": "<|startoftext|>",
              "eot_token_id": "<|eot_id|>"},
    "dream": {"mask_token_id": "<|mask|>", "eos_token_id": "<|endoftext|>", "bos_token_id": "<|beginoftext|>",
              "eot_token_id": "<|im_end|>"},
}
_CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {{ eot }} {% endfor %}"
                  "{% if add_generation_prompt %}assistant {% endif %}")


def write_tokenizer(out_dir: str, config: ModelConfig) -> None:
  """A word-level tokenizer over `config.vocab_size` ids ('w{i}', specials at the config's ids) that
  transformers' AutoTokenizer loads offline, with a minimal chat template."""
  from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

  names = _SPECIAL_NAMES.get(config.family, _SPECIAL_NAMES["llada"])
  special: dict[int, str] = {}
  for field, token in names.items():
    token_id = getattr(config, field)
    if token_id is not None and 0 <= token_id < config.vocab_size:
      special.setdefault(token_id, token)
  vocab = {special.get(i, f"w{i}"): i for i in range(config.vocab_size)}
  tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special.values()])
  tok.save(os.path.join(out_dir, "tokenizer.json"))
  eot = special.get(config.eot_token_id) if config.eot_token_id is not None else None
  token = lambda field: special.get(getattr(config, field)) if getattr(config, field) is not None else None  # noqa
  tokenizer_config = {
      "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096, "unk_token": "w0",
      "eos_token": token("eos_token_id"), "pad_token": token("pad_token_id"), "bos_token": token("bos_token_id"),
      "mask_token": token("mask_token_id"), "add_bos_token": False, "add_eos_token": False,
      "chat_template": _CHAT_TEMPLATE.replace("{{ eot }}", eot or ""),
  }
  with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
    json.dump(tokenizer_config, f, indent=2)
    f.write("\n")
  with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
    json.dump({k: v for k, v in tokenizer_config.items() if k.endswith("_token") and v}, f, indent=2)
    f.write("\n")
