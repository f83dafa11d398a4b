"""Our parameter tree -> a Hugging Face LLaDA / Dream directory (sharded safetensors + index + config.json).

The inverse of hf_import through the same mapping table: HF -> converted -> HF gives the same tensor
names, dtypes and bytes. Tensors are written grouped by parameter (all layers' q_proj, then k_proj, ...), so
a lazily loaded model needs one stacked parameter plus one HF tensor in memory at a time.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

import numpy as np
from tqdm import tqdm

from d2f_jax.convert import mapping
from d2f_jax.convert.mapping import check_params
from d2f_jax.convert.hf_config import ATTENTION_KEY, attention_of, check_same_shapes, hf_config_from_model
from d2f_jax.convert.safetensors import TensorSpec, write_sharded
from d2f_jax.convert.model_card import CARD_FILE, hf_card
from d2f_jax.convert.util import as_numpy_dtype, assign, atomic_dir, copy_aux_files
from d2f_jax.models.config import ModelConfig

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' save_pretrained default ("5GB")


def _load_hf_config(hf_config_json) -> dict | None:
  if hf_config_json is None or isinstance(hf_config_json, dict):
    return hf_config_json
  if os.path.isfile(hf_config_json):
    with open(hf_config_json) as f:
      return json.load(f)
  return json.loads(hf_config_json)


def export_hf(out_dir, config: ModelConfig, params: dict | Callable[[str], Any], *,
              hf_config_json: dict | str | None = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, dtype=None,
              aux_dir: str | None = None, overwrite: bool = False, progress: bool = False,
              base_model: str | None = None, attention: str | None = None) -> str:
  """Write `params` (our layout) as a Hugging Face checkpoint directory.

  params: the nested tree (numpy or jax arrays), or a function path -> array ('layers/q') that loads one
    parameter on demand; tensors are written grouped by parameter, so then only one is held at a time.
  hf_config_json: the original config.json (dict, JSON text or a path), written back verbatim after checking it
    describes these shapes; default: generated in the family's format.
  dtype: tensor dtype in the files; default: each parameter's own dtype.
  aux_dir: directory whose tokenizer / side files are copied along.
  base_model: the checkpoint these weights were trained or converted from, for the model card.
  attention: how the model was trained to attend ('causal', 'bidirectional', 'block_causal'), written to
    config.json (ATTENTION_KEY; default: keep what hf_config_json says) and the card.
  """
  shapes = mapping.param_shapes(config)
  if callable(params):
    load = params
  else:
    check_params(config, params)
    flat = mapping.flatten(params)
    load = flat.__getitem__
  hf_cfg = _load_hf_config(hf_config_json)
  if hf_cfg is not None:
    check_same_shapes(config, hf_cfg, source="hf_config_json")
    if config.attention_kind not in (None, attention_of(hf_cfg, "hf_config_json")):  # e.g. a base's config.json:
      hf_cfg = {**hf_cfg, ATTENTION_KEY: config.attention_kind}  # how the base attends, not this model
  entries = mapping.expected_tensors(config, order="param")
  current: dict[str, np.ndarray] = {}

  def param(path: str, keep: tuple[str, ...] = ()) -> np.ndarray:
    if path not in current:
      for other in [p for p in current if p not in keep]:
        del current[other]  # drop the previous parameter(s) before loading the next
      value = np.asarray(load(path))
      if tuple(value.shape) != shapes[path]:
        raise ValueError(f"parameter {path} has shape {tuple(value.shape)}, expected {shapes[path]}")
      current[path] = value
    return current[path]

  if dtype is not None:
    file_dtype = {p: as_numpy_dtype(dtype) for p in shapes}
  elif not callable(params):
    file_dtype = {p: np.dtype(flat[p].dtype) for p in shapes}
  elif hasattr(params, "dtypes"):  # e.g. checkpoint.LeafLoader: dtypes from metadata, nothing loaded yet
    file_dtype = {p: np.dtype(params.dtypes[p]) for p in shapes}
  else:
    file_dtype = {p: np.asarray(load(p)).dtype for p in shapes}
  specs = [TensorSpec(e.hf, file_dtype[e.parts[0].path], e.hf_shape) for e in entries.values()]
  if hf_cfg is None:
    hf_cfg = hf_config_from_model(config, dtype=file_dtype["embedding"].name)
  if attention is not None:
    hf_cfg = {**hf_cfg, ATTENTION_KEY: attention}

  def produce(spec: TensorSpec) -> np.ndarray:
    entry = entries[spec.name]
    paths = tuple(part.path for part in entry.parts)  # a fused tensor's parts stay loaded together
    out = np.empty(entry.hf_shape, spec.dtype)
    for part in entry.parts:
      view = part.of(np.ascontiguousarray(param(part.path, keep=paths)))
      assign(out if part.rows is None else out[part.rows[0]:part.rows[1]], view)
    return out

  with atomic_dir(out_dir, overwrite=overwrite) as tmp, \
      tqdm(total=sum(s.nbytes for s in specs), unit="B", unit_scale=True, desc="export", disable=not progress,
           leave=False) as bar:
    write_sharded(tmp, specs, produce, max_shard_bytes=max_shard_bytes, metadata={"format": "pt"},
                  on_written=lambda s: bar.update(s.nbytes))
    current.clear()
    with open(os.path.join(tmp, "config.json"), "w") as f:
      json.dump(hf_cfg, f, indent=2)
      f.write("\n")
    copy_aux_files(aux_dir, tmp)
    with open(os.path.join(tmp, CARD_FILE), "w") as f:
      f.write(hf_card(config, os.fspath(base_model) if base_model else None, hf_cfg.get(ATTENTION_KEY)))
  return os.fspath(out_dir)
