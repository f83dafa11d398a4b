"""The two whole conversions the CLI runs: HF (+ PEFT adapter) -> converted directory, and back."""

from __future__ import annotations

import dataclasses
import gc
import os

from d2f_jax.convert.checkpoint import LeafLoader, is_converted_dir, read_converted_meta, restore_tree, save_converted
from d2f_jax.convert.errors import ConvertError
from d2f_jax.convert.hf_config import read_hf_config
from d2f_jax.convert.hf_export import DEFAULT_MAX_SHARD_BYTES, export_hf
from d2f_jax.convert.hf_import import load_hf_params
from d2f_jax.convert.lora import export_peft_adapter, merge_lora, read_adapter_config, read_peft_adapter
from d2f_jax.convert.mapping import lora_shapes
from d2f_jax import workdir_lock
from d2f_jax.convert.util import check_apart, check_out_dir


def convert_hf_dir(hf_dir, out_dir, *, lora_dir=None, merge: bool = False, dtype=None, allow_pickle: bool = False,
                   overwrite: bool = False, progress: bool = True, allow_nonfinite: bool = False) -> str:
  """Hugging Face directory (+ optional PEFT adapter, merged or kept separate) -> converted directory.
  NaN / inf weights are refused (naming the tensor and index) unless `allow_nonfinite`."""
  hf_dir, out_dir = os.fspath(hf_dir), os.fspath(out_dir)
  check_apart(out_dir, {"--hf_dir": hf_dir, "--lora_dir": lora_dir})  # --overwrite would delete the source
  with workdir_lock.hold(out_dir, what="convert output", beside=True):  # two converts into one --out
    check_out_dir(os.path.abspath(out_dir), overwrite)  # fail before the expensive part
    return _convert(hf_dir, out_dir, lora_dir, merge, dtype, allow_pickle, overwrite, progress, allow_nonfinite)


def _convert(hf_dir, out_dir, lora_dir, merge, dtype, allow_pickle, overwrite, progress, allow_nonfinite) -> str:
  if is_converted_dir(hf_dir):  # which of the two did the user mean? (load_model refuses it too)
    raise ConvertError(f"--hf_dir {hf_dir!r} holds both a converted model (d2f_model.json) and a Hugging Face "
                       "checkpoint: give a directory holding only the Hugging Face files")
  _, hf_config = read_hf_config(hf_dir)
  config, params = load_hf_params(hf_dir, dtype=dtype, allow_pickle=allow_pickle, progress=progress,
                                  allow_nonfinite=allow_nonfinite)
  lora_cfg = lora_params = None
  source = {"hf_dir": os.path.abspath(hf_dir), "lora_dir": os.path.abspath(lora_dir) if lora_dir else None,
            "lora_merged": bool(lora_dir and merge)}
  extra = {"source": source}
  if lora_dir is not None:
    lora_cfg, lora_params = read_peft_adapter(lora_dir, config, allow_pickle=allow_pickle,
                                              allow_nonfinite=allow_nonfinite)
    source["lora_base_model_name_or_path"] = read_adapter_config(lora_dir, config.family)[1].get(
        "base_model_name_or_path")
    if merge:
      params = merge_lora(params, lora_cfg, lora_params, config, inplace=True, allow_nonfinite=allow_nonfinite)
      extra["merged_lora"] = dataclasses.asdict(lora_cfg)
      lora_cfg = lora_params = None
  save_converted(out_dir, config, params, lora_cfg=lora_cfg, lora_params=lora_params, hf_config=hf_config,
                 source_dir=hf_dir, overwrite=overwrite, extra=extra)
  del params, lora_params
  gc.collect()
  return out_dir


def export_converted(converted_dir, out_dir=None, *, lora_out=None, dtype=None,
                     max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, overwrite: bool = False,
                     progress: bool = False) -> dict[str, str]:
  """A converted directory back to Hugging Face form: the base model to `out_dir` (original config.json and
  tokenizer files), its separate LoRA, if any, as a PEFT adapter to `lora_out`. Returns what was written."""
  if out_dir is None and lora_out is None:
    raise ConvertError("export_converted needs out_dir and/or lora_out")
  converted_dir = os.fspath(converted_dir)
  config, lora_cfg, meta = read_converted_meta(converted_dir)
  if lora_out is not None and lora_cfg is None:
    raise ConvertError(f"{converted_dir!r} has no separate LoRA adapter to export (merged, or never added)")
  for path, flag in ((out_dir, "--out"), (lora_out, "--export_lora")):
    if path is not None:
      check_apart(path, {"--converted": converted_dir}, flag)
      check_out_dir(os.path.abspath(os.fspath(path)), overwrite)
  if out_dir is not None and lora_out is not None:
    check_apart(lora_out, {"--out": out_dir}, "--export_lora")
  written = {}
  if out_dir is not None:  # streamed: one stacked parameter in memory at a time
    loader = LeafLoader(os.path.join(converted_dir, "params"), version=meta["version"])
    written["hf"] = export_hf(out_dir, config, loader, hf_config_json=meta.get("hf_config"),
                              max_shard_bytes=max_shard_bytes, dtype=dtype, aux_dir=converted_dir,
                              overwrite=overwrite, progress=progress,
                              base_model=(meta.get("source") or {}).get("hf_dir"))
  if lora_out is not None:
    lora_params = restore_tree(os.path.join(converted_dir, "lora"), lora_shapes(config, lora_cfg),
                               version=meta["version"])
    base_name = (meta.get("source") or {}).get("lora_base_model_name_or_path")
    written["lora"] = export_peft_adapter(lora_out, config, lora_cfg, lora_params, base_model_name_or_path=base_name,
                                          overwrite=overwrite)
  return written
