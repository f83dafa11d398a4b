"""The safetensors format itself: its dtype codes, the names of its files, its error and where a tensor lives.

Format: 8-byte little-endian header length N, N bytes of JSON header
({name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}), then raw
little-endian tensor bytes. Reading (read.py) and writing (write.py) share these.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes  # noqa: F401  (registers bfloat16 / float8 with numpy, which safe_open(framework="np") needs)
import numpy as np

from d2f_jax.convert.errors import ConvertError

INDEX_SUFFIX = ".safetensors.index.json"
SINGLE_FILE = "model.safetensors"

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"), "U32": np.dtype("<u4"), "U16": np.dtype("<u2"), "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
DTYPE_CODES = {dtype: code for code, dtype in DTYPES.items()}


class SafetensorsError(ConvertError):
  """A safetensors file or index that cannot be read as such."""


def dtype_code(dtype) -> str:
  dtype = np.dtype(dtype)
  if dtype not in DTYPE_CODES:
    raise SafetensorsError(f"dtype {dtype} has no safetensors code; supported: {sorted(map(str, DTYPE_CODES))}")
  return DTYPE_CODES[dtype]


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  """Where one tensor's bytes live: absolute byte range [start, end) of `path`."""
  name: str
  dtype: np.dtype
  shape: tuple[int, ...]
  path: str
  start: int
  end: int

  @property
  def nbytes(self) -> int:
    return self.end - self.start
