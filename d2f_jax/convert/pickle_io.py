"""Reader for PyTorch pickle checkpoints (`*.bin` / `*.pt`), only on explicit request.

Unpickling can run code, so the importer refuses these files unless the caller opts in; even then they are
loaded with `torch.load(weights_only=True)`, one file at a time, behind the same interface as
`d2f_jax.convert.safetensors.CheckpointReader`.
"""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np

from d2f_jax.convert.errors import CheckpointError, one_line
from d2f_jax.convert.safetensors import TensorInfo

PICKLE_SUFFIXES = (".bin", ".pt", ".pth")


def find_pickles(directory: str) -> list[str]:
  """Weight files of a pickle checkpoint: those named by `*.bin.index.json`, else every *.bin / *.pt."""
  entries = sorted(os.listdir(directory))
  for entry in entries:
    if entry.endswith((".bin.index.json", ".pt.index.json")):
      path = os.path.join(directory, entry)
      try:
        with open(path) as f:
          shards = sorted(set(json.load(f)["weight_map"].values()))
      except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{path}: not a pickle checkpoint index with a 'weight_map' ({one_line(e)})") from e
      return [os.path.join(directory, s) for s in shards]
  return [os.path.join(directory, e) for e in entries
          if e.endswith(PICKLE_SUFFIXES) and not e.startswith(("training_args", "optimizer", "scheduler", "rng_state"))]


def _to_numpy(tensor) -> np.ndarray:
  import torch
  tensor = tensor.detach().cpu().contiguous()
  if tensor.dtype == torch.bfloat16:
    return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
  return tensor.numpy()


class PickleReader:
  """Tensors of one or more torch pickle files; keeps at most one file loaded."""

  def __init__(self, files: list[str]):
    self.root = os.path.dirname(files[0]) if files else ""
    self.infos: dict[str, TensorInfo] = {}
    self._loaded_path: str | None = None
    self._loaded: dict = {}
    for path in files:
      offset = 0
      for name, tensor in self._load(path).items():
        if name in self.infos:
          raise CheckpointError(f"tensor {name!r} appears in both {self.infos[name].path} and {path}")
        array_dtype = np.dtype(ml_dtypes.bfloat16) if str(tensor.dtype) == "torch.bfloat16" else \
            np.dtype(str(tensor.dtype).replace("torch.", ""))
        nbytes = tensor.numel() * array_dtype.itemsize
        self.infos[name] = TensorInfo(name, array_dtype, tuple(tensor.shape), path, offset, offset + nbytes)
        offset += nbytes

  def _load(self, path: str) -> dict:
    if self._loaded_path != path:
      import torch
      self._loaded = {}
      try:
        try:
          state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:  # legacy (non-zip) format cannot be memory-mapped
          if "mmap" not in str(e):
            raise
          state = torch.load(path, map_location="cpu", weights_only=True)
      except Exception as e:  # UnpicklingError (a global weights_only refuses), a corrupt zip, EOF, ...
        raise CheckpointError(f"{path}: refused by torch.load(weights_only=True), so not loaded: "
                              f"{one_line(e)[:400]}") from e
      if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                for k, v in state.items()):
        raise CheckpointError(f"{path}: expected a state dict of named tensors, got {type(state).__name__}")
      self._loaded, self._loaded_path = state, path
    return self._loaded

  def __contains__(self, name: str) -> bool:
    return name in self.infos

  def names(self) -> list[str]:
    return list(self.infos)

  def read(self, name: str, out: np.ndarray | None = None, rows: tuple[int, int] | None = None) -> np.ndarray:
    info = self.infos[name]
    array = _to_numpy(self._load(info.path)[name])
    if rows is not None:
      array = array[rows[0]:rows[1]]
    if out is None:
      return np.array(array)
    out[...] = array
    return out

  def close(self) -> None:
    self._loaded, self._loaded_path = {}, None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
