"""PEFT LoRA adapters <-> our LoRA parameters; merging them into base weights.

PEFT stores, per adapted Linear, `base_model.model.<module>.lora_A.weight` [r, in] and `lora_B.weight`
[out, r] and computes y += scale * x @ A.T @ B.T. Ours are a = A.T [L, in, r] and b = B.T [L, r, out]
(q: b [L, r, H*D]; o: a [L, H*D, r]), so the update is scale * x @ a @ b and W' = W + scale * a @ b in our
[in, out] layout, exactly PEFT's W + scale * B @ A transposed.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np

from d2f_jax.convert import families, mapping
from d2f_jax.convert.errors import ConvertError
from d2f_jax.convert.finite import check_finite
from d2f_jax.convert.validate import build_lora_config, get_bool, get_float, get_int, read_json_object
from d2f_jax.convert.hf_import import checkpoint_dtype, copy_tensor, is_float_dtype
from d2f_jax.convert.pickle_io import PickleReader
from d2f_jax.convert.safetensors import CheckpointReader, TensorSpec, write_file
from d2f_jax.convert.util import as_numpy_dtype, atomic_dir
from d2f_jax.convert.model_card import CARD_FILE, adapter_card
from d2f_jax.models.config import LORA_TARGETS, LoraConfig, ModelConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
DEFAULT_BASE_NAMES = {"llada": "GSAI-ML/LLaDA-8B-Instruct", "dream": "Dream-org/Dream-v0-Base-7B"}

# W' = W + scale * a @ b per layer, in our layout (named letters: e embed, f mlp, q heads * head dim, r rank).
MERGE_EINSUM = {"q": "er,rq->eq", "k": "er,rq->eq", "v": "er,rq->eq", "o": "qr,re->qe",
                "gate": "er,rf->ef", "up": "er,rf->ef", "down": "fr,re->fe"}

_LORA_NAME = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")


class AdapterError(ConvertError):
  """An adapter that does not fit the base model or uses PEFT features this converter does not support."""


def peft_target_names(family: str) -> dict[str, str]:
  """PEFT target_modules name -> our target, e.g. {'attn_out': 'o', ...} for LLaDA."""
  table = families.table_for(family)
  return {table.peft_target(t): t for t in LORA_TARGETS if table.has_module(t)}


def _check_peft_family(family: str) -> None:
  if not peft_target_names(family):
    raise AdapterError(f"PEFT adapters of {family} checkpoints are not converted: their q / k / v are one fused "
                       "Linear (query_key_value) and their MLPs experts; LoRA trained in d2f_jax stays in its "
                       "checkpoints")


def peft_names(family: str, target: str, layer: int) -> tuple[str, str, str]:
  """(lora_A name, lora_B name, base weight name) of one target in one layer."""
  table = families.table_for(family)
  module = table.module(target).format(i=layer)
  return (f"{table.peft_prefix}{module}.lora_A.weight", f"{table.peft_prefix}{module}.lora_B.weight",
          f"{module}.weight")


def peft_adapter_config(config: ModelConfig, lora: LoraConfig, base_model_name_or_path: str | None = None) -> dict:
  """adapter_config.json as PEFT writes it for a plain LoRA on the base's Linear layers."""
  table = families.table_for(config.family)
  alpha = int(lora.alpha) if float(lora.alpha).is_integer() else lora.alpha
  return {
      "alpha_pattern": {}, "auto_mapping": None,
      "base_model_name_or_path": base_model_name_or_path or DEFAULT_BASE_NAMES[config.family],
      "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
      "layers_pattern": None, "layers_to_transform": None, "lora_alpha": alpha, "lora_dropout": lora.dropout,
      "modules_to_save": None, "peft_type": "LORA", "r": lora.rank, "rank_pattern": {}, "revision": None,
      "target_modules": sorted(table.peft_target(t) for t in lora.targets), "task_type": "CAUSAL_LM",
      "use_dora": False, "use_rslora": lora.use_rslora,
  }


def _targets(value, family: str, source: str) -> tuple[str, ...]:
  known = peft_target_names(family)
  if isinstance(value, str):
    value = list(known) if value == "all-linear" else [value]
  if not isinstance(value, (list, tuple)) or not value:
    raise AdapterError(f"{source}: target_modules must be a non-empty list of module names, got {value!r}")
  targets = set()
  for name in value:
    if not isinstance(name, str):
      raise AdapterError(f"{source}: target_modules must list module names (strings), got {name!r}")
    short = name.rsplit(".", 1)[-1]
    if short not in known:
      other = [f for f in families.TABLES if f != family and short in peft_target_names(f)]
      hint = f" ('{short}' is a {other[0]} module name: is this adapter for a {other[0]} base?)" if other else ""
      raise AdapterError(f"{source}: unsupported target module name {name!r} for a {family} base; supported: "
                         f"{sorted(known)}{hint}")
    targets.add(known[short])
  return tuple(t for t in LORA_TARGETS if t in targets)


def read_adapter_config(adapter_dir: str, family: str) -> tuple[LoraConfig, dict]:
  """(LoraConfig, raw adapter_config.json), refusing PEFT options that change the math."""
  _check_peft_family(family)
  path = os.path.join(os.fspath(adapter_dir), ADAPTER_CONFIG)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{adapter_dir!r} has no {ADAPTER_CONFIG} (is it a PEFT adapter directory?)")
  try:
    raw = read_json_object(path)
  except ConvertError as e:
    raise AdapterError(str(e)) from e
  if raw.get("peft_type", "LORA") != "LORA":
    raise AdapterError(f"{path}: peft_type {raw['peft_type']!r} is not supported, only 'LORA'")
  for field, ok in (("use_dora", lambda v: not v), ("fan_in_fan_out", lambda v: not v),
                    ("layers_to_transform", lambda v: v is None), ("rank_pattern", lambda v: not v),
                    ("alpha_pattern", lambda v: not v), ("modules_to_save", lambda v: not v),
                    ("bias", lambda v: v in (None, "none")), ("lora_bias", lambda v: not v)):
    if not ok(raw.get(field)):
      raise AdapterError(f"{path}: {field}={raw[field]!r} is not supported")
  for field in ("r", "lora_alpha", "target_modules"):
    if raw.get(field) is None:
      raise AdapterError(f"{path}: missing field {field!r}")
  try:
    lora = build_lora_config(
        path, rank=get_int(raw, "r", path), alpha=get_float(raw, "lora_alpha", path),
        dropout=get_float(raw, "lora_dropout", path, default=0.0, positive=False, below=1.0),
        targets=_targets(raw["target_modules"], family, path), use_rslora=get_bool(raw, "use_rslora", path))
  except AdapterError:
    raise
  except ConvertError as e:
    raise AdapterError(str(e)) from e
  return lora, raw


def _open_adapter(adapter_dir: str, allow_pickle: bool):
  path = os.path.join(adapter_dir, ADAPTER_WEIGHTS)
  if os.path.isfile(path):
    return CheckpointReader(path)
  pickle = os.path.join(adapter_dir, "adapter_model.bin")
  if os.path.isfile(pickle):
    if not allow_pickle:
      raise AdapterError(f"{adapter_dir!r} holds only the pickle adapter_model.bin; pass allow_pickle=True to load "
                         "it with torch.load(weights_only=True)")
    return PickleReader([pickle])
  raise FileNotFoundError(f"{adapter_dir!r} has no {ADAPTER_WEIGHTS}")


def read_peft_adapter(adapter_dir, config: ModelConfig, *, dtype=None, allow_pickle: bool = False,
                      allow_nonfinite: bool = False) -> tuple[LoraConfig, dict]:
  """(LoraConfig, {'layers': {'q_lora_a': [L, E, r], ...}}) of a PEFT adapter for a base of `config`.

  dtype: storage dtype of the LoRA parameters; default keeps the adapter's.
  """
  adapter_dir = os.fspath(adapter_dir)
  lora, _ = read_adapter_config(adapter_dir, config.family)
  table = families.table_for(config.family)
  modules = {table.module(t).format(i=i): (t, i) for t in LORA_TARGETS for i in range(config.num_layers)}
  base = mapping.expected_tensors(config)
  with _open_adapter(adapter_dir, allow_pickle) as reader:
    where = os.path.join(adapter_dir, ADAPTER_WEIGHTS)
    found: dict[tuple[str, int, str], str] = {}
    for name in reader.names():
      m = _LORA_NAME.match(name)
      if m is None:
        raise AdapterError(f"{where}: tensor {name!r} is not a lora_A / lora_B weight (only plain LoRA on Linear "
                           "layers is supported)")
      module = m.group("module")
      if module not in modules:
        other = mapping.guess_family([module + ".weight"])
        if other and other != config.family:
          raise AdapterError(f"{where}: tensor {name!r} names a {other} module: the adapter is for a {other} base, "
                             f"but the base model is {config.family}")
        raise AdapterError(f"{where}: tensor {name!r} adapts module {module!r}, which is not a supported target of "
                           f"a {config.family} base with {config.num_layers} layers (targets: "
                           f"{sorted(peft_target_names(config.family))})")
      target, layer = modules[module]
      if target not in lora.targets:
        raise AdapterError(f"{where}: tensor {name!r} adapts {table.peft_target(target)!r}, which is not in "
                           f"target_modules of {ADAPTER_CONFIG}")
      found[(target, layer, m.group("ab"))] = name
    missing = [peft_names(config.family, t, i)[ab == "B"] for t in lora.targets for i in range(config.num_layers)
               for ab in "AB" if (t, i, ab) not in found]
    if missing:
      raise AdapterError(f"{where}: missing {len(missing)} LoRA tensor(s) for target_modules "
                         f"{sorted(table.peft_target(t) for t in lora.targets)}, e.g. {missing[:4]}")
    for (target, layer, ab), name in found.items():
      out_features, in_features = base[peft_names(config.family, target, layer)[2]].hf_shape
      expected = (lora.rank, in_features) if ab == "A" else (out_features, lora.rank)
      got = tuple(reader.infos[name].shape)
      if not is_float_dtype(reader.infos[name].dtype):
        raise AdapterError(f"{where}: tensor {name!r} has dtype {np.dtype(reader.infos[name].dtype).name}, expected "
                           "a floating-point dtype")
      if got != expected:
        raise AdapterError(f"{where}: tensor {name!r} has shape {list(got)}, expected {list(expected)} for rank "
                           f"{lora.rank} on this {config.family} base (adapter for a different base?)")
    target_dtype = as_numpy_dtype(dtype) if dtype is not None else checkpoint_dtype(reader.infos.values())
    flat = {p: np.empty(s, target_dtype) for p, s in mapping.lora_shapes(config, lora).items()}
    for (target, layer, ab), name in found.items():
      transform = mapping.lora_transforms(target)[ab == "B"]
      dest = flat[f"layers/{target}_lora_{ab.lower()}"][layer]
      copy_tensor(reader, reader.infos[name], transform.hf_view(dest))
      check_finite(name, transform.hf_view(dest), where, allow=allow_nonfinite)
  return lora, mapping.unflatten(flat)


def merge_lora(params: dict, lora: LoraConfig, lora_params: dict, config: ModelConfig | None = None, *,
               inplace: bool = False, allow_nonfinite: bool = False) -> dict:
  """Base params with W' = W + scale * a @ b folded in (fp32 math, cast back to W's dtype), per layer of every
  stack the adapter holds (`layers`, and `moe_layers` of a mixture of experts).

  Returns a new tree; `inplace=True` overwrites the base arrays instead of allocating new ones.
  """
  stacks = {k: v for k, v in lora_params.items() if k in ("layers", "moe_layers")} or {"layers": lora_params}
  shapes = mapping.param_shapes(config) if config is not None else {}
  out_params = dict(params)
  for stack, lora_layers in stacks.items():
    layers = dict(params[stack])
    for t in lora.targets:
      if t not in layers and f"{t}_lora_a" not in lora_layers:
        continue  # a projection this stack does not have (an expert stack's MLP): no adapter was made for it
      if t not in layers or f"{t}_lora_a" not in lora_layers:
        raise AdapterError(f"{stack}/{t}: " + ("the base has no such parameter" if t not in layers else
                                               f"the adapter has no {t}_lora_a / {t}_lora_b for it"))
      w = layers[t]
      a, b = lora_layers[f"{t}_lora_a"], lora_layers[f"{t}_lora_b"]
      if shapes and tuple(w.shape) != shapes[f"{stack}/{t}"]:
        raise AdapterError(f"base parameter {stack}/{t} has shape {tuple(w.shape)}, expected "
                           f"{shapes[f'{stack}/{t}']} for the config")
      out = w if inplace else np.empty(w.shape, np.dtype(w.dtype))
      for layer in range(w.shape[0]):
        delta = np.einsum(MERGE_EINSUM[t], np.asarray(a[layer], np.float32), np.asarray(b[layer], np.float32),
                          optimize=True)
        if delta.shape != tuple(w.shape[1:]):
          raise AdapterError(f"LoRA update for {stack}/{t} has shape {delta.shape}, base layer shape {w.shape[1:]}")
        out[layer] = (np.asarray(w[layer], np.float32) + np.float32(lora.scale) * delta).astype(out.dtype)
        check_finite(f"{stack}/{t}[{layer}] merged with its LoRA update", out[layer], "merge_lora",
                     allow=allow_nonfinite)
      layers[t] = out
    out_params[stack] = layers
  return out_params


def with_lora(params: dict, lora_params: dict | None) -> dict:
  """One tree holding base and LoRA parameters, the layout of `nnx.state(Transformer(cfg, lora))`."""
  if not lora_params:
    return params
  return {**params, "layers": {**params["layers"], **lora_params["layers"]}}


def split_lora(tree: dict) -> tuple[dict, dict]:
  """Inverse of `with_lora`: (base params, {'layers': {*_lora_a / *_lora_b}})."""
  layers = tree["layers"]
  lora = {k: v for k, v in layers.items() if "_lora_" in k}
  return {**tree, "layers": {k: v for k, v in layers.items() if k not in lora}}, {"layers": lora}


def export_peft_adapter(out_dir, config: ModelConfig, lora: LoraConfig, lora_params: dict, *,
                        base_model_name_or_path: str | None = None, dtype=None, overwrite: bool = False) -> str:
  """Write our LoRA parameters as a PEFT adapter directory (adapter_config.json + adapter_model.safetensors)."""
  _check_peft_family(config.family)
  lora_layers = lora_params["layers"] if "layers" in lora_params else lora_params
  shapes = mapping.lora_shapes(config, lora)
  specs, sources = [], {}
  for i in range(config.num_layers):
    for t in lora.targets:
      for ab, name in zip("ab", peft_names(config.family, t, i)[:2]):
        param = np.asarray(lora_layers[f"{t}_lora_{ab}"])
        if tuple(param.shape) != shapes[f"layers/{t}_lora_{ab}"]:
          raise AdapterError(f"LoRA parameter layers/{t}_lora_{ab} has shape {tuple(param.shape)}, expected "
                             f"{shapes[f'layers/{t}_lora_{ab}']}")
        transform = mapping.lora_transforms(t)[ab == "b"]
        view = transform.hf_view(np.ascontiguousarray(param[i]))
        out_dtype = as_numpy_dtype(dtype) if dtype is not None else view.dtype
        specs.append(TensorSpec(name, out_dtype, tuple(view.shape)))
        sources[name] = view
  with atomic_dir(out_dir, overwrite=overwrite) as tmp:
    write_file(os.path.join(tmp, ADAPTER_WEIGHTS), specs,
               lambda s: np.ascontiguousarray(sources[s.name]).astype(s.dtype, copy=False), {"format": "pt"})
    with open(os.path.join(tmp, ADAPTER_CONFIG), "w") as f:
      json.dump(peft_adapter_config(config, lora, base_model_name_or_path), f, indent=2)
      f.write("\n")
    with open(os.path.join(tmp, CARD_FILE), "w") as f:
      f.write(adapter_card(config, lora, base_model_name_or_path))
  return os.fspath(out_dir)
