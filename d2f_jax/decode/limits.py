"""Up-front checks of a decode request, so a bad one fails in milliseconds with the offending value named,
instead of compiling and running for minutes (`max_new_tokens=2**20`) or decoding garbage (a float id cast
to an int, an id past the vocabulary).

Three checks, all before anything is traced: prompt token ids are integers inside the vocabulary; the
longest row (prompt + response) stays within the positions the model was trained for
(`ModelConfig.max_positions`, from config.json's max_sequence_length / max_position_embeddings); the KV
cache and the weights fit the memory budget (`DecodeConfig.memory_budget_gib`, by default the memory of
the devices that decode).
"""

from __future__ import annotations

import numpy as np

import jax

from d2f_jax.models import ModelConfig

GIB = 1024 ** 3


class DecodeInputError(ValueError):
  """A decode request refused before anything ran; the CLIs print it as one `error:` line, exit status 2."""


def prompt_rows(prompts, mask=None) -> list[np.ndarray]:
  """Rows of int64 token ids from a ragged list of id lists or a [B, T] array (+ mask of real tokens).

  Only integers are ids: floats, bools and strings are refused, naming the row and the value."""
  if isinstance(prompts, (list, tuple)) and (not prompts or not np.isscalar(prompts[0])) and mask is None:
    rows = [_int_row(p, b) for b, p in enumerate(prompts)]
  else:
    array = _int_row(prompts, None)
    if array.ndim != 2:
      raise DecodeInputError(f"prompt_ids must be a list of id lists or a [batch, length] array, got shape "
                             f"{array.shape}")
    keep = np.ones(array.shape, bool) if mask is None else np.asarray(mask).astype(bool)
    if keep.shape != array.shape:
      raise DecodeInputError(f"mask shape {keep.shape} != prompt_ids shape {array.shape}")
    rows = [array[b][keep[b]] for b in range(array.shape[0])]
  if not rows:
    raise DecodeInputError("prompt_ids holds no prompts")
  return rows


def _int_row(values, row: int | None) -> np.ndarray:
  where = "prompt_ids" if row is None else f"prompt {row}"
  if isinstance(values, (list, tuple)):
    bad = [v for v in _flat(values) if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer))]
    if bad:
      raise DecodeInputError(f"{where} holds {bad[0]!r} ({type(bad[0]).__name__}); token ids must be integers")
  array = np.asarray(values)
  if array.dtype.kind not in "iu" and not (array.size == 0 and array.dtype.kind == "f"):
    raise DecodeInputError(f"{where} has dtype {array.dtype}; token ids must be integers")
  array = array.astype(np.int64)
  return array.reshape(-1) if row is not None else array


def _flat(values):
  for v in values:
    if isinstance(v, (list, tuple, np.ndarray)):
      yield from _flat(v)
    else:
      yield v


def check_vocabulary(rows: list[np.ndarray], config: ModelConfig) -> None:
  for b, row in enumerate(rows):
    if row.size == 0:
      raise DecodeInputError(f"prompt {b} is empty; every row needs at least one token")
    if row.min() < 0 or row.max() >= config.vocab_size:
      bad = int(row[(row < 0) | (row >= config.vocab_size)][0])
      raise DecodeInputError(f"prompt {b} has token id {bad}, outside the vocabulary [0, {config.vocab_size}) "
                             f"(ids seen: [{row.min()}, {row.max()}])")


def check_positions(config: ModelConfig, longest_prompt: int, max_new_tokens: int) -> None:
  """The last response position must be one the model was trained for."""
  if config.max_positions is None:
    return
  need = longest_prompt + max_new_tokens
  if need > config.max_positions:
    raise DecodeInputError(
        f"a prompt of {longest_prompt} tokens + max_new_tokens={max_new_tokens} needs {need} positions, but the "
        f"model was trained for {config.max_positions} (ModelConfig.max_positions, config.json's "
        f"max_sequence_length / max_position_embeddings); lower max_new_tokens or shorten the prompt")


def kv_cache_bytes(config: ModelConfig, batch: int, length: int) -> int:
  """Bytes of the static cache: K and V [L, B, length, K, D] in the compute dtype."""
  return (2 * config.num_layers * batch * length * config.num_kv_heads * config.head_dim
          * np.dtype(config.compute_dtype).itemsize)


def state_nbytes(state) -> int:
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state) if hasattr(x, "dtype")))


def device_memory_bytes(devices) -> int | None:
  """Memory of the devices that decode: the accelerators' own limit, or the host's available memory on
  CPU. None when unknown."""
  total = 0
  for device in devices:
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and stats.get("bytes_limit"):
      total += int(stats["bytes_limit"])
    elif device.platform == "cpu":
      import psutil
      return int(psutil.virtual_memory().available)  # CPU devices share the host's memory
    else:
      return None
  return total or None


def check_memory(config: ModelConfig, batch: int, length: int, state, devices,
                 budget_gib: float | None = None) -> None:
  """The cache of `batch` rows of `length` positions plus the weights fit the budget (GiB), or by
  default the devices' memory."""
  budget = budget_gib * GIB if budget_gib is not None else device_memory_bytes(devices)
  if budget is None:
    return
  cache, weights = kv_cache_bytes(config, batch, length), state_nbytes(state)
  if cache + weights > budget:
    where = f"memory_budget_gib={budget_gib}" if budget_gib is not None else \
        f"the {budget / GIB:.2f} GiB of {len(devices)} {devices[0].platform} device(s)"
    raise DecodeInputError(
        f"decoding {batch} row(s) of {length} positions needs a {cache / GIB:.2f} GiB KV cache "
        f"({config.num_layers} layers x {config.num_kv_heads} kv heads x {config.head_dim} x "
        f"{np.dtype(config.compute_dtype).name}) + {weights / GIB:.2f} GiB of weights, more than {where}; "
        "lower max_new_tokens or the batch, or decode on a mesh")
