"""Hugging Face LLaDA / Dream checkpoint -> our parameter tree, streamed tensor by tensor.

Every parameter of ours is allocated once, at its final (stacked) shape and dtype; each HF tensor is read
straight into its slot (or through a small row buffer when it must be transposed or cast), so peak memory is
about one copy of the model, never two.
"""

from __future__ import annotations

import logging
import math
import os
from collections import Counter

import ml_dtypes
import numpy as np
from tqdm import tqdm

from d2f_jax.convert import families, mapping
from d2f_jax.convert.errors import CheckpointError
from d2f_jax.convert.finite import check_finite
from d2f_jax.convert.hf_config import declared_dtype, read_hf_config
from d2f_jax.convert.pickle_io import PickleReader, find_pickles
from d2f_jax.convert.safetensors import CheckpointReader, TensorInfo, find_safetensors
from d2f_jax.convert.util import as_numpy_dtype, assign
from d2f_jax.models.config import ModelConfig

log = logging.getLogger(__name__)

CHUNK_BYTES = 32 << 20  # row buffer for transposed / cast copies
_MAX_LISTED = 8


def open_weights(hf_dir: str, allow_pickle: bool = False):
  """A reader over the directory's safetensors weights, or its pickle weights when `allow_pickle`."""
  if find_safetensors(hf_dir) is not None:
    return CheckpointReader(hf_dir)
  pickles = find_pickles(hf_dir)
  if pickles:
    if not allow_pickle:
      raise CheckpointError(
          f"{hf_dir!r} holds only PyTorch pickle weights ({', '.join(os.path.basename(p) for p in pickles)}); "
          "unpickling can execute code, so they are refused. Pass allow_pickle=True (--allow_pickle) to load them "
          "with torch.load(weights_only=True), or convert them to safetensors first.")
    return PickleReader(pickles)
  raise FileNotFoundError(f"{hf_dir!r} holds no weights (looked for model.safetensors, *.safetensors.index.json, "
                          "*.safetensors, *.bin, *.pt)")


def _listing(names, infos: dict[str, TensorInfo] | None = None) -> str:
  names = sorted(names)
  shown = [f"{n} (in {os.path.basename(infos[n].path)})" if infos and n in infos else n for n in names[:_MAX_LISTED]]
  more = f" and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else ""
  return ", ".join(shown) + more


def is_float_dtype(dtype) -> bool:
  dtype = np.dtype(dtype)
  return dtype.kind == "f" or dtype in (as_numpy_dtype("bfloat16"), np.dtype(ml_dtypes.float8_e4m3fn),
                                        np.dtype(ml_dtypes.float8_e5m2))


def check_tensors(infos: dict[str, TensorInfo], entries: dict[str, mapping.Entry], config: ModelConfig,
                  where: str, declared_dtype: str | None = None) -> None:
  """Every expected tensor present, every present tensor expected, every shape as config.json implies, every
  dtype a float one and (when config.json names a torch_dtype) that one: checked before any model is built,
  so relabelled bytes (F32 -> I32) are refused here instead of building an int32 model."""
  present = {n for n in infos if not n.endswith(families.IGNORED_SUFFIXES)}
  missing, unexpected = set(entries) - present, present - set(entries)
  if missing or unexpected:
    other = mapping.guess_family(present)
    hint = (f" The tensor names are those of a {other} checkpoint but config.json says {config.family}."
            if other and other != config.family else "")
    parts = []
    if missing:
      parts.append(f"missing {len(missing)} tensor(s) that config.json requires: {_listing(missing)}")
    if unexpected:
      parts.append(f"{len(unexpected)} unexpected tensor(s) that a {config.family} model with this config.json does "
                   f"not use: {_listing(unexpected, infos)}")
    raise CheckpointError(f"checkpoint {where!r}: " + "; ".join(parts) + "." + hint)
  expected_dtype = as_numpy_dtype(declared_dtype) if declared_dtype else None
  for name, entry in entries.items():
    info = infos[name]
    if tuple(info.shape) != entry.hf_shape:
      raise CheckpointError(f"checkpoint {where!r}: tensor {name!r} in {os.path.basename(info.path)} has shape "
                            f"{list(info.shape)}, expected {list(entry.hf_shape)} from config.json")
    if expected_dtype is not None and np.dtype(info.dtype) != expected_dtype:
      raise CheckpointError(f"checkpoint {where!r}: tensor {name!r} in {os.path.basename(info.path)} has dtype "
                            f"{np.dtype(info.dtype).name}, expected {expected_dtype.name} (config.json torch_dtype)")
    if not is_float_dtype(info.dtype):
      raise CheckpointError(f"checkpoint {where!r}: tensor {name!r} in {os.path.basename(info.path)} has dtype "
                            f"{np.dtype(info.dtype).name}, expected a floating-point dtype for model weights")


def check_sizes(infos: dict[str, TensorInfo], config: ModelConfig, where: str) -> None:
  """Refuse a config.json whose sizes are far beyond the files' headers (more layers than tensors, or over twice
  the weights, counted in closed form) before anything loops over its layers or allocates by its sizes:
  n_layers 10^12 grew convert past 15 GB. Smaller differences get check_tensors' exact, per-tensor message."""
  expected = sum(math.prod(shape) for shape in mapping.param_shapes(config).values())
  present = sum(math.prod(info.shape) for name, info in infos.items() if not name.endswith(families.IGNORED_SUFFIXES))
  if config.num_layers > len(infos) or expected > 2 * present:
    c = config
    raise CheckpointError(
        f"checkpoint {where!r}: config.json describes {expected:,} weights (num_layers={c.num_layers}, "
        f"embed_dim={c.embed_dim}, num_heads={c.num_heads}, num_kv_heads={c.num_kv_heads}, head_dim={c.head_dim}, "
        f"mlp_dim={c.mlp_dim}, vocab_size={c.vocab_size}) but the weight files' headers hold {present:,} in "
        f"{len(infos)} tensors: "
        "config.json does not describe these files")


def checkpoint_dtype(infos) -> np.dtype:
  """The dtype holding most of the bytes (real checkpoints use one dtype throughout)."""
  by_bytes = Counter()
  for info in infos:
    by_bytes[np.dtype(info.dtype)] += info.nbytes
  if len(by_bytes) > 1:
    log.warning("checkpoint mixes dtypes %s; converting all to the majority one", dict(by_bytes))
  return by_bytes.most_common(1)[0][0]


def copy_tensor(reader, info: TensorInfo, dest: np.ndarray, rows: tuple[int, int] | None = None) -> None:
  """Copy one HF tensor (or its `rows` [start, stop): one part of a fused tensor) into `dest` (an HF-layout
  view of our parameter), through a row buffer if needed."""
  shape = info.shape
  if not shape:
    dest[...] = reader.read(info.name)
    return
  start, stop = (0, shape[0]) if rows is None else rows
  if dest.flags.c_contiguous and dest.dtype == info.dtype:
    reader.read(info.name, out=dest, rows=rows)
    return
  row_bytes = max(1, info.nbytes // max(1, shape[0]))
  step = max(1, min(stop - start, CHUNK_BYTES // row_bytes))
  buf = np.empty((step,) + tuple(shape[1:]), info.dtype)
  for lo in range(start, stop, step):
    hi = min(stop, lo + step)
    block = reader.read(info.name, out=buf[:hi - lo], rows=(lo, hi))
    assign(dest[lo - start:hi - start], block)


def load_hf_params(hf_dir: str, *, dtype=None, allow_pickle: bool = False, progress: bool = True,
                   allow_nonfinite: bool = False) -> tuple[ModelConfig, dict]:
  """(ModelConfig, params) of a Hugging Face LLaDA / Dream directory, params as numpy arrays in our layout.

  dtype: storage dtype of the result ('bfloat16', 'float32', ...); default keeps the checkpoint's. The
  returned config's `param_dtype` and `dtype` are set to it. A NaN / inf weight is refused (NonFiniteWeights,
  naming the tensor and index) unless `allow_nonfinite`.
  """
  hf_dir = os.fspath(hf_dir)
  config, raw = read_hf_config(hf_dir)
  with open_weights(hf_dir, allow_pickle) as reader:
    check_sizes(reader.infos, config, hf_dir)
    entries = mapping.expected_tensors(config)
    check_tensors(reader.infos, entries, config, hf_dir, declared_dtype(raw))
    infos = [reader.infos[n] for n in entries]
    target = as_numpy_dtype(dtype) if dtype is not None else checkpoint_dtype(infos)
    flat = {path: np.empty(shape, target) for path, shape in mapping.param_shapes(config).items()}
    order = sorted(entries.values(), key=lambda e: (reader.infos[e.hf].path, reader.infos[e.hf].start))
    with tqdm(total=sum(i.nbytes for i in infos), unit="B", unit_scale=True, desc=f"import {os.path.basename(hf_dir)}",
              disable=not progress, leave=False) as bar:
      for entry in order:
        info = reader.infos[entry.hf]
        for part in entry.parts:
          view = part.of(flat[part.path])
          copy_tensor(reader, info, view, part.rows)
          check_finite(info.name, view, f"checkpoint {hf_dir!r} ({os.path.basename(info.path)})",
                       allow=allow_nonfinite)
        bar.update(info.nbytes)
  name = target.name
  return config.replace(dtype=name, param_dtype=name), mapping.unflatten(flat)
