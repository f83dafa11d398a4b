"""Converted model directories: orbax params (+ LoRA), our config as JSON, tokenizer and side files.

Layout of `<out>`:
  params/         orbax PyTree checkpoint of the parameter tree (numpy or jax arrays)
  lora/           same for LoRA parameters, when kept separate from the base
  d2f_model.json  {"format", "version", "config": ModelConfig, "lora": LoraConfig | null,
                   "hf_config": original config.json | null, "aux_files": [...], "source": {...}}
  tokenizer.json, tokenizer_config.json, ... copied from the Hugging Face directory
Arrays are written uncompressed and without orbax's defensive host copy, so saving costs no second copy of
the model in memory; the directory is built under `<out>.tmp-XXXX` and renamed into place.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import type_handlers

from d2f_jax.convert import mapping
from d2f_jax.convert.errors import CheckpointError, ConvertError, one_line
from d2f_jax.convert.hf_config import attention_of
from d2f_jax.convert.finite import check_tree
from d2f_jax.convert.mapping import check_params
from d2f_jax.convert.model_card import CARD_FILE, converted_card
from d2f_jax.convert.lora import split_lora
from d2f_jax.convert.util import as_numpy_dtype, atomic_dir, copy_aux_files
from d2f_jax.convert.validate import (ConfigError, lora_config_from_dict, model_config_from_dict, read_json_object,
                                      require_object)
from d2f_jax.models.config import LoraConfig, ModelConfig

META_FILE = "d2f_model.json"
FORMAT = "d2f_jax.converted"
# 2: every projection one [in, out] matrix per layer, heads packed with head_dim (q [L, E, H*D], o [L, H*D, E]).
# 1: q / k / v [L, E, heads, D] and o [L, H, D, E] (LoRA: q / k / v b [L, r, heads, D], o a [L, H, D, r]). The
# bytes are the same in C order, so a version-1 directory is read by restoring its arrays as saved and
# reshaping them (`_packed`); converting or saving again writes version 2.
VERSION = 2
READABLE_VERSIONS = (1, 2)
_HEADS_OUT = ("layers/q", "layers/k", "layers/v", "layers/q_lora_b", "layers/k_lora_b", "layers/v_lora_b")
_HEADS_IN = ("layers/o", "layers/o_lora_a")


def packed_shape(leaf: str, shape) -> tuple[int, ...]:
  """The version-2 shape of a version-1 array at `leaf` ('layers/q', or any path ending so, e.g. a training
  state's 'params/layers/q_lora_b'); other shapes unchanged."""
  shape = tuple(shape)
  if len(shape) == 4 and any(leaf == n or leaf.endswith("/" + n) for n in _HEADS_OUT):
    return (*shape[:2], shape[2] * shape[3])
  if len(shape) == 4 and any(leaf == n or leaf.endswith("/" + n) for n in _HEADS_IN):
    return (shape[0], shape[1] * shape[2], shape[3])
  return shape


def _packed(leaf: str, array):
  """A version-1 array in the version-2 layout (a reshape: no byte moves)."""
  return array.reshape(packed_shape(leaf, array.shape))


def is_converted_dir(path) -> bool:
  return os.path.isfile(os.path.join(os.fspath(path), META_FILE))


def _checkpointer() -> ocp.Checkpointer:
  registry = type_handlers.create_type_handler_registry(
      (np.ndarray, type_handlers.NumpyHandler(deepcopy_host_arrays=False)),
      (jax.Array, type_handlers.ArrayHandler()),
  )
  handler = ocp.PyTreeCheckpointHandler(type_handler_registry=registry, use_compression=False)
  return ocp.Checkpointer(handler)


def save_tree(path: str, tree: dict) -> None:
  """One orbax PyTree checkpoint of numpy / jax arrays at `path` (which must not exist)."""
  checkpointer = _checkpointer()
  try:
    checkpointer.save(path, args=ocp.args.PyTreeSave(tree))
  finally:
    checkpointer.close()


def restore_tree(path: str, shapes: dict[str, tuple], *, dtype=None, target: dict | None = None,
                 version: int = VERSION) -> dict:
  """Restore an orbax tree: as numpy arrays (optionally cast to `dtype`), or, given `target` (a tree of
  jax.ShapeDtypeStruct with shardings), straight into jax arrays laid out on those devices. A tree written in
  format `version` 1 is restored as saved, reshaped to today's layout, then placed on the target's devices."""
  checkpointer = _checkpointer()
  try:
    if version != 1:
      return _restore(checkpointer, path, shapes, dtype, target)
    restored = mapping.flatten(_restore(checkpointer, path, shapes, dtype, None))
    flat = {leaf: _packed(leaf, x) for leaf, x in restored.items()}
    if target is not None:
      want = mapping.flatten(target)
      flat = {leaf: jax.device_put(x.astype(want[leaf].dtype), want[leaf].sharding) for leaf, x in flat.items()}
    return mapping.unflatten(flat)
  except (ConvertError, TypeError):  # TypeError: a caller's bug, not the files'
    raise
  except Exception as e:  # orbax / tensorstore errors of a damaged directory
    raise CheckpointError(f"{path}: cannot restore the orbax checkpoint ({one_line(e)[:300]})") from e
  finally:
    checkpointer.close()


def _restore(checkpointer, path: str, shapes: dict[str, tuple], dtype, target) -> dict:
  if target is not None:
    restore_args = ocp.checkpoint_utils.construct_restore_args(target)
    return checkpointer.restore(path, args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args))
  np_dtype = as_numpy_dtype(dtype) if dtype is not None else None
  args = mapping.unflatten({p: ocp.RestoreArgs(restore_type=np.ndarray, dtype=np_dtype) for p in shapes})
  return checkpointer.restore(path, args=ocp.args.PyTreeRestore(restore_args=args))


def restore_leaf(path: str, leaf: str, dtype=None) -> np.ndarray:
  """One array ('layers/q') of an orbax tree as numpy, without reading the others: lets export stream the
  model one parameter at a time."""
  np_dtype = as_numpy_dtype(dtype) if dtype is not None else None
  args = mapping.unflatten({leaf: ocp.RestoreArgs(restore_type=np.ndarray, dtype=np_dtype)})
  item = mapping.unflatten({leaf: 0})
  checkpointer = _checkpointer()
  try:
    tree = checkpointer.restore(path, args=ocp.args.PyTreeRestore(item=item, restore_args=args, partial_restore=True))
  finally:
    checkpointer.close()
  return mapping.flatten(tree)[leaf]


def tree_metadata(path: str) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
  """{leaf path: (shape, dtype)} of an orbax tree, from its metadata only."""
  checkpointer = _checkpointer()
  try:
    meta = checkpointer.metadata(path)
  except Exception as e:  # a damaged or missing _METADATA
    raise CheckpointError(f"{path}: unreadable orbax metadata ({one_line(e)[:300]})") from e
  finally:
    checkpointer.close()
  tree = getattr(getattr(meta, "item_metadata", meta), "tree", None)
  if not isinstance(tree, dict):
    raise CheckpointError(f"{path}: unreadable orbax metadata ({type(meta).__name__})")
  return {p: (tuple(m.shape), np.dtype(m.dtype)) for p, m in mapping.flatten(tree).items()}


class LeafLoader:
  """`loader('layers/q')` restores one parameter of an orbax tree; `loader.dtypes` comes from metadata.
  What export_hf takes to stream a converted model one parameter at a time (a format-`version` 1 tree's
  arrays reshaped to today's layout)."""

  def __init__(self, path: str, dtype=None, version: int = VERSION):
    self.path, self.dtype, self.version = path, dtype, version
    self.dtypes = {p: (as_numpy_dtype(dtype) if dtype is not None else d) for p, (_, d) in tree_metadata(path).items()}

  def __call__(self, leaf: str) -> np.ndarray:
    if leaf not in self.dtypes:
      raise KeyError(f"{self.path}: no parameter {leaf!r}; has {sorted(self.dtypes)}")
    array = restore_leaf(self.path, leaf, self.dtype)
    return _packed(leaf, array) if self.version == 1 else array


def save_converted(out_dir, config: ModelConfig, params: dict, *, lora_cfg: LoraConfig | None = None,
                   lora_params: dict | None = None, hf_config: dict | None = None, source_dir: str | None = None,
                   overwrite: bool = False, extra: dict | None = None) -> str:
  """Write a converted model directory (see module doc). `source_dir`: the HF directory whose tokenizer and
  side files are copied. Refuses a non-empty `out_dir` unless `overwrite`."""
  check_params(config, params)
  if (lora_cfg is None) != (lora_params is None):
    raise ValueError("lora_cfg and lora_params must be given together")
  if lora_cfg is not None:
    check_params(config, lora_params, "lora params", mapping.lora_shapes(config, lora_cfg))
  with atomic_dir(out_dir, overwrite=overwrite) as tmp:
    save_tree(os.path.join(tmp, "params"), params)
    if lora_params is not None:
      save_tree(os.path.join(tmp, "lora"), lora_params)
    aux = copy_aux_files(source_dir, tmp)
    meta = {"format": FORMAT, "version": VERSION, "family": config.family, "config": dataclasses.asdict(config),
            "lora": dataclasses.asdict(lora_cfg) if lora_cfg else None, "hf_config": hf_config,
            "aux_files": aux, **(extra or {})}
    with open(os.path.join(tmp, META_FILE), "w") as f:
      json.dump(meta, f, indent=2)
      f.write("\n")
    with open(os.path.join(tmp, CARD_FILE), "w") as f:
      f.write(converted_card(config, lora_cfg, os.fspath(source_dir) if source_dir else None))
  return os.fspath(out_dir)


def read_converted_meta(path) -> tuple[ModelConfig, LoraConfig | None, dict]:
  """(config, LoRA config or None, full d2f_model.json) without touching the arrays; every field of
  'config' and 'lora' type-checked, token ids inside the vocabulary (errors name the file and field)."""
  meta_path = os.path.join(os.fspath(path), META_FILE)
  if not os.path.isfile(meta_path):
    raise FileNotFoundError(f"{path!r} is not a converted model directory (no {META_FILE})")
  meta = read_json_object(meta_path)
  if meta.get("format") != FORMAT or meta.get("version") not in READABLE_VERSIONS:
    raise ConfigError(f"{meta_path}: format {meta.get('format')!r} version {meta.get('version')!r}, expected "
                      f"{FORMAT!r} version {' or '.join(map(str, READABLE_VERSIONS))}")
  config = model_config_from_dict(meta.get("config"), meta_path, "config")
  lora = lora_config_from_dict(meta["lora"], meta_path, "lora") if meta.get("lora") is not None else None
  if meta.get("hf_config") is not None:
    require_object(meta["hf_config"], meta_path, "hf_config")
    if config.attention_kind is None:  # converted before the config kept it: its original config.json says
      config = config.replace(attention_kind=attention_of(meta["hf_config"], f"{meta_path} hf_config"))
  return config, lora, meta


def _abstract_tree(target) -> dict:
  """A pure dict of jax.ShapeDtypeStruct from an nnx.State / dict of arrays, Variables or structs; leaves
  without a sharding go to the first device."""
  if type(target) is not dict:
    from flax import nnx
    target = nnx.to_pure_dict(target)
  default = jax.sharding.SingleDeviceSharding(jax.devices()[0])

  def leaf(x):
    x = getattr(x, "value", x)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None) or default)
  return jax.tree.map(leaf, target)


def restore_converted(path, dtype=None, *, target: Any = None, allow_nonfinite: bool = False
                      ) -> tuple[ModelConfig, dict, LoraConfig | None, dict | None]:
  """(config, params, lora_cfg, lora_params) of a converted directory.

  dtype: cast numpy results ('bfloat16', 'float32'); config.param_dtype / dtype follow it.
  target: abstract tree (pure dict or nnx.State) of jax.ShapeDtypeStruct with shardings, e.g.
    `nnx.state(nnx.eval_shape(lambda: Transformer(cfg, lora, rngs=nnx.Rngs(0))), nnx.Param)` with shardings
    filled in: arrays are restored straight onto the mesh. Its LoRA leaves (`*_lora_a/b`), if any, receive
    the saved LoRA parameters.
  NaN / inf weights are refused, naming the parameter and index, unless `allow_nonfinite`.
  """
  path = os.fspath(path)
  config, params, lora_cfg, lora_params = _restore_converted(path, dtype, target)
  check_tree(params, os.path.join(path, "params"), allow=allow_nonfinite)
  check_tree(lora_params or {}, os.path.join(path, "lora"), allow=allow_nonfinite)
  return config, params, lora_cfg, lora_params


def _restore_converted(path: str, dtype, target):
  config, lora_cfg, meta = read_converted_meta(path)
  version = meta["version"]
  base_shapes = mapping.param_shapes(config)
  lora_shapes = mapping.lora_shapes(config, lora_cfg) if lora_cfg else {}
  has_lora_dir = os.path.isdir(os.path.join(path, "lora"))
  if target is not None:
    base_target, lora_target = split_lora(_abstract_tree(target))
    if not lora_target["layers"]:
      lora_target = None
    params = restore_tree(os.path.join(path, "params"), base_shapes, target=base_target, version=version)
    lora_params = None
    if lora_cfg is not None and has_lora_dir:
      lora_params = restore_tree(os.path.join(path, "lora"), lora_shapes, target=lora_target, version=version)
    name = np.dtype(base_target["embedding"].dtype).name
    return config.replace(dtype=name, param_dtype=name), params, lora_cfg, lora_params
  params = restore_tree(os.path.join(path, "params"), base_shapes, dtype=dtype, version=version)
  lora_params = (restore_tree(os.path.join(path, "lora"), lora_shapes, version=version)
                 if lora_cfg and has_lora_dir else None)
  if dtype is not None:
    name = as_numpy_dtype(dtype).name
    config = config.replace(dtype=name, param_dtype=name)
  return config, params, lora_cfg, lora_params
