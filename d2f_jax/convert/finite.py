"""Non-finite weights refused where they enter or leave: at load, at convert, at a LoRA merge and at the
trainer's export.

Why: a NaN or inf in one base weight or LoRA tensor converted with exit 0, loaded and merged, and decoding then
returned the mask id at every position with no error. The check names the tensor and the first bad index;
`allow_nonfinite=True` (`--allow_nonfinite`) lets such weights through, for forensics. It reads each tensor
once more, in row blocks (a bool mask of one block at a time, not of the whole tensor).
"""

from __future__ import annotations

import numpy as np

from d2f_jax.convert.errors import CheckpointError

_BLOCK_ELEMENTS = 1 << 22


class NonFiniteWeights(CheckpointError):
  """A weight holding NaN or inf; the message names the file, the tensor and the first bad index."""


def _is_float(dtype) -> bool:
  dtype = np.dtype(dtype)
  return dtype.kind == "f" or dtype.name in ("bfloat16", "float8_e4m3fn", "float8_e5m2")


def first_nonfinite(array) -> tuple[int, ...] | None:
  """Index of the first NaN / inf of `array` (numpy, or a jax array checked on its device first), or None."""
  if hasattr(array, "devices") and not isinstance(array, np.ndarray):  # a jax.Array: one reduction where it lives
    import jax.numpy as jnp
    if not _is_float(array.dtype) or bool(jnp.isfinite(array).all()):
      return None
    array = np.asarray(array)
  array = np.asarray(array)
  if not _is_float(array.dtype):
    return None
  if array.ndim == 0:
    return None if np.isfinite(array) else ()
  step = max(1, _BLOCK_ELEMENTS // max(1, array[:1].size))
  for lo in range(0, array.shape[0], step):
    bad = ~np.isfinite(array[lo:lo + step])
    if bad.any():
      index = np.argwhere(bad)[0]
      return (lo + int(index[0]),) + tuple(int(i) for i in index[1:])
  return None


ALLOW_HINT = "Pass allow_nonfinite=True (--allow_nonfinite) to load it anyway, for forensics"


def check_finite(name: str, array, where: str, *, allow: bool = False, hint: str = ALLOW_HINT) -> None:
  """NonFiniteWeights naming `where`, the tensor and the first bad index, unless `allow`."""
  if allow:
    return
  index = first_nonfinite(array)
  if index is not None:
    value = np.asarray(array[index] if index else array)
    raise NonFiniteWeights(f"{where}: tensor {name!r} holds {float(value)} at index {list(index)} (its first "
                           f"non-finite value): a model with NaN / inf weights decodes garbage. {hint}")


def check_tree(tree, where: str, *, allow: bool = False, prefix: str = "", hint: str = ALLOW_HINT) -> None:
  """check_finite on every leaf of a nested dict, named by its path ('layers/q')."""
  if allow:
    return
  for key, value in tree.items():
    if isinstance(value, dict):
      check_tree(value, where, prefix=f"{prefix}{key}/", hint=hint)
    else:
      check_finite(f"{prefix}{key}", value, where, hint=hint)
