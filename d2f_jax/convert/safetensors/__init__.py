"""Safetensors files without torch: the one place callers import them from (`d2f_jax.convert.safetensors`).

  format.py  the format itself: dtype codes, file names, SafetensorsError, TensorInfo (where a tensor lives)
  read.py    validated headers, CheckpointReader (a file or an index's shards, by row chunks), find_safetensors
  write.py   the streaming writer: write_file, plan_shards + write_sharded (index last), save_file

Not to be confused with the third-party `safetensors` library, which read.py uses: every import in d2f_jax is
absolute, so `import safetensors` always means the library and this package is always reached by its full name.
"""

from __future__ import annotations

from d2f_jax.convert.safetensors.format import (DTYPE_CODES, DTYPES, INDEX_SUFFIX, SINGLE_FILE, SafetensorsError,
                                                TensorInfo, dtype_code)
from d2f_jax.convert.safetensors.read import READ_CHUNK_BYTES, CheckpointReader, find_safetensors, read_header
from d2f_jax.convert.safetensors.write import TensorSpec, plan_shards, save_file, write_file, write_sharded

__all__ = [
    "DTYPES", "DTYPE_CODES", "INDEX_SUFFIX", "SINGLE_FILE", "READ_CHUNK_BYTES", "SafetensorsError", "TensorInfo",
    "dtype_code", "read_header", "CheckpointReader", "find_safetensors", "TensorSpec", "plan_shards", "save_file",
    "write_file", "write_sharded",
]
