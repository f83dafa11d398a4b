"""One validation of model configs, wherever they come from: config.json, d2f_model.json, adapter_config.json.

Every field is read through a typed getter that names the file and the field in its error (`rope_theta="abc"`,
`n_kv_heads="four"`, `mlp_hidden_size: [160]`, a JSON list instead of an object), and every finished
ModelConfig goes through `check_token_ids`: a special token id outside the vocabulary would decode to
meaningless tokens instead of failing.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

from d2f_jax.convert.errors import ConvertError, one_line
from d2f_jax.kernels.common import ATTENTION_IMPLS
from d2f_jax.models.config import ATTENTION_KINDS, EXPERT_DISPATCHES, LoraConfig, ModelConfig, MoEConfig

_MISSING = object()
TOKEN_FIELDS = ("mask_token_id", "eos_token_id", "pad_token_id", "bos_token_id", "eot_token_id")
OPTIONAL_TOKEN_FIELDS = ("bos_token_id", "eot_token_id")


class ConfigError(ConvertError):
  """A model / adapter config that cannot be used as it is; the message names the file and the field."""


def read_json_object(path: str, what: str = "config") -> dict:
  """The JSON object in `path`; a missing file is FileNotFoundError, anything else a ConfigError naming it."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{what} file {path!r} does not exist")
  try:
    with open(path, encoding="utf-8") as f:
      raw = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ConfigError(f"{path}: not valid JSON ({one_line(e)})") from e
  except OSError as e:
    raise ConfigError(f"{path}: cannot be read ({one_line(e)})") from e
  return require_object(raw, path)


def require_object(raw: Any, source: str, field: str | None = None) -> dict:
  if not isinstance(raw, dict):
    where = f"field {field!r}" if field else "the file"
    raise ConfigError(f"{source}: {where} must be a JSON object {{...}}, got {type(raw).__name__} {_short(raw)}")
  return raw


def _short(value) -> str:
  text = repr(value)
  return text if len(text) <= 60 else text[:57] + "..."


def _is_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def get_int(raw: dict, field: str, source: str, *, default=_MISSING, minimum: int | None = 1):
  """An integer field (bools and floats refused); `default` when absent or null, an error when there is none."""
  value = raw.get(field)
  if value is None:
    if default is _MISSING:
      raise ConfigError(f"{source}: missing field {field!r}")
    return default
  if not _is_int(value) or (minimum is not None and value < minimum):
    bound = "an integer" if minimum is None else ("a positive integer" if minimum == 1 else f"an integer >= {minimum}")
    raise ConfigError(f"{source}: field {field!r} must be {bound}, got {_short(value)}")
  return value


def get_float(raw: dict, field: str, source: str, *, default=_MISSING, positive: bool = True,
              below: float | None = None) -> float:
  """A finite number field (JSON int or float; strings and bools refused)."""
  value = raw.get(field)
  if value is None:
    if default is _MISSING:
      raise ConfigError(f"{source}: missing field {field!r}")
    return default
  ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
  if ok and positive:
    ok = value > 0
  if ok and below is not None:
    ok = 0 <= value < below
  if not ok:
    want = "a finite number" + (" > 0" if positive else "") + (f" in [0, {below})" if below is not None else "")
    raise ConfigError(f"{source}: field {field!r} must be {want}, got {_short(value)}")
  return float(value)


def get_bool(raw: dict, field: str, source: str, *, default: bool | None = False):
  value = raw.get(field)
  if value is None:
    return default
  if not isinstance(value, bool):
    raise ConfigError(f"{source}: field {field!r} must be true or false, got {_short(value)}")
  return value


def get_str(raw: dict, field: str, source: str, *, default=_MISSING, choices=None):
  value = raw.get(field)
  if value is None:
    if default is _MISSING:
      raise ConfigError(f"{source}: missing field {field!r}")
    return default
  if not isinstance(value, str) or (choices is not None and value not in choices):
    want = f"one of {list(choices)}" if choices is not None else "a string"
    raise ConfigError(f"{source}: field {field!r} must be {want}, got {_short(value)}")
  return value


def token_id(value, field: str, source: str) -> int | None:
  """A token id as config.json gives it: an int, null, or a list of ints (several eos ids; the first counts)."""
  if isinstance(value, list):
    if not all(_is_int(v) for v in value):
      raise ConfigError(f"{source}: field {field!r} must be an integer token id or a list of them, got "
                        f"{_short(value)}")
    return value[0] if value else None
  if value is not None and not _is_int(value):
    raise ConfigError(f"{source}: field {field!r} must be an integer token id, got {_short(value)}")
  return value


def check_token_ids(config: ModelConfig, source: str, defaults_used: tuple[str, ...] = ()) -> ModelConfig:
  """Every special token id an int inside [0, vocab_size) (bos / eot may be None)."""
  for field in TOKEN_FIELDS:
    value = getattr(config, field)
    if value is None and field in OPTIONAL_TOKEN_FIELDS:
      continue
    if not _is_int(value) or not 0 <= value < config.vocab_size:
      note = f" (the released {config.family} default: {source} does not set it)" if field in defaults_used else ""
      raise ConfigError(f"{source}: field {field!r} = {_short(value)}{note} is not a token id of the vocabulary "
                        f"[0, {config.vocab_size})")
  return config


def build_model_config(source: str, **fields) -> ModelConfig:
  """ModelConfig(**fields), its own checks (heads divide, even head_dim, dtype names) named by `source`."""
  try:
    return ModelConfig(**fields)
  except (TypeError, ValueError) as e:
    raise ConfigError(f"{source}: {one_line(e)}") from e


# --- d2f_model.json's "config" / "lora": our dataclasses as JSON ------------------------------------

def _field_kind(field: dataclasses.Field) -> str:
  kind = str(field.type).replace(" ", "")
  return {"Family": "family"}.get(kind, kind)


def _known_fields(raw: Any, cls, source: str, field: str) -> tuple[dict, dict[str, dataclasses.Field]]:
  """(raw as a JSON object, the dataclass's fields by name), refusing a field the dataclass does not have."""
  raw = require_object(raw, source, field)
  fields = {f.name: f for f in dataclasses.fields(cls)}
  unknown = sorted(set(raw) - set(fields))
  if unknown:
    raise ConfigError(f"{source}: field {field!r} has unknown {cls.__name__} field(s) {unknown}; "
                      f"known: {sorted(fields)}")
  return raw, fields


def model_config_from_dict(raw: Any, source: str, field: str = "config") -> ModelConfig:
  """A ModelConfig from its dataclasses.asdict() form, every field's type checked and named."""
  raw, fields = _known_fields(raw, ModelConfig, source, field)
  values = {}
  for name, f in fields.items():
    label, kind = f"{field}.{name}", _field_kind(f)
    has_default = f.default is not dataclasses.MISSING
    if name not in raw:
      if not has_default:
        raise ConfigError(f"{source}: missing field {label!r}")
      continue
    sub = {label: raw[name]}
    if kind == "int":
      values[name] = get_int(sub, label, source, minimum=0 if name in TOKEN_FIELDS else 1)
    elif kind == "int|None":
      values[name] = get_int(sub, label, source, default=None, minimum=0)
    elif kind == "float":
      values[name] = get_float(sub, label, source)
    elif kind == "bool":
      values[name] = get_bool(sub, label, source, default=f.default)
    elif kind == "family":
      values[name] = get_str(sub, label, source, choices=("llada", "dream", "llada2", "custom"))
    elif name == "moe":
      values[name] = None if raw[name] is None else moe_config_from_dict(raw[name], source, label)
    elif name == "attention_impl":
      values[name] = get_str(sub, label, source, choices=ATTENTION_IMPLS)
    elif name == "attention_kind":
      values[name] = get_str(sub, label, source, default=None, choices=ATTENTION_KINDS)
    else:
      values[name] = get_str(sub, label, source)
  return check_token_ids(build_model_config(source, **values), source)


def moe_config_from_dict(raw: Any, source: str, field: str = "config.moe") -> MoEConfig:
  """A MoEConfig from its dataclasses.asdict() form, every field's type checked and named."""
  raw, fields = _known_fields(raw, MoEConfig, source, field)
  values = {}
  for name, f in fields.items():
    label = f"{field}.{name}"
    default = f.default if f.default is not dataclasses.MISSING else _MISSING
    sub = {label: raw.get(name)}
    if f.type == "int":
      values[name] = get_int(sub, label, source, default=default, minimum=0)
    elif f.type == "float":
      values[name] = get_float(sub, label, source, default=default)
    elif f.type == "bool":
      values[name] = get_bool(sub, label, source, default=default)
    else:
      values[name] = get_str(sub, label, source, default=default, choices=EXPERT_DISPATCHES)
  try:
    return MoEConfig(**values)
  except ValueError as e:
    raise ConfigError(f"{source}: {one_line(e)}") from e


def lora_config_from_dict(raw: Any, source: str, field: str = "lora") -> LoraConfig:
  """A LoraConfig from its dataclasses.asdict() form, every field's type checked and named."""
  raw, _ = _known_fields(raw, LoraConfig, source, field)
  targets = raw.get("targets", list(LoraConfig.targets))
  if not isinstance(targets, (list, tuple)) or not all(isinstance(t, str) for t in targets):
    raise ConfigError(f"{source}: field '{field}.targets' must be a list of target names, got {_short(targets)}")
  return build_lora_config(
      source, rank=get_int(raw, "rank", source, default=LoraConfig.rank),
      alpha=get_float(raw, "alpha", source, default=LoraConfig.alpha),
      dropout=get_float(raw, "dropout", source, default=LoraConfig.dropout, positive=False, below=1.0),
      targets=tuple(targets), use_rslora=get_bool(raw, "use_rslora", source, default=False))


def build_lora_config(source: str, **fields) -> LoraConfig:
  try:
    return LoraConfig(**fields)
  except (TypeError, ValueError) as e:
    raise ConfigError(f"{source}: {one_line(e)}") from e
