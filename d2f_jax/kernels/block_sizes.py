"""Tile sizes of the attention kernels, with each backend's hardware constraints and defaults.

Block sizes never change the numbers a kernel computes (up to summation order), only its speed. The
defaults are sensible starting points, not tuned values: tune them with `python -m d2f_jax.bench attention`.
"""

from __future__ import annotations

import dataclasses

from d2f_jax.kernels.common import next_pow2, round_up

_FIELDS = ("block_q", "block_k", "block_q_dkv", "block_k_dkv", "block_q_dq", "block_k_dq")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiles of the forward and backward kernels.

  block_q / block_k: query rows / key rows per tile of the forward pass. In window attention a query row
    is one (window token, query head) pair of one kv head, and block_k tiles the KV cache.
  block_q_dkv / block_k_dkv: tiles of the dK/dV backward kernel (default: the forward ones).
  block_q_dq / block_k_dq: tiles of the dQ backward kernel (default: the forward ones).
  """

  block_q: int = 128
  block_k: int = 128
  block_q_dkv: int | None = None
  block_k_dkv: int | None = None
  block_q_dq: int | None = None
  block_k_dq: int | None = None

  def __post_init__(self):
    for name in _FIELDS:
      value = getattr(self, name)
      if value is None and name not in ("block_q", "block_k"):
        continue
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"BlockSizes.{name} must be a positive int, got {value!r}")

  @classmethod
  def get_default(cls, backend: str, kernel: str = "flash") -> "BlockSizes":
    """Starting points per backend ("gpu" | "tpu") and kernel ("flash" | "window")."""
    if backend not in ("gpu", "tpu"):
      raise ValueError(f"backend must be 'gpu' or 'tpu', got {backend!r}")
    if kernel not in ("flash", "window"):
      raise ValueError(f"kernel must be 'flash' or 'window', got {kernel!r}")
    if backend == "gpu":
      # Triton: one program holds a [block_q, block_k] score tile and a [block_q, D] accumulator.
      if kernel == "window":
        return cls(block_q=64, block_k=64)
      return cls(block_q=128, block_k=64, block_q_dkv=64, block_k_dkv=64, block_q_dq=64, block_k_dq=64)
    # Mosaic: keys sit on the 128 lanes of a score tile; larger key tiles amortise the per-step overhead.
    if kernel == "window":
      return cls(block_q=256, block_k=256)
    return cls(block_q=128, block_k=256, block_q_dkv=128, block_k_dkv=128, block_q_dq=128, block_k_dq=256)

  @property
  def backward(self) -> tuple[int, int, int, int]:
    """(block_q_dkv, block_k_dkv, block_q_dq, block_k_dq), falling back to the forward tiles."""
    pick = lambda value, default: default if value is None else value
    return (pick(self.block_q_dkv, self.block_q), pick(self.block_k_dkv, self.block_k),
            pick(self.block_q_dq, self.block_q), pick(self.block_k_dq, self.block_k))

  def resolved(self) -> "BlockSizes":
    q_dkv, k_dkv, q_dq, k_dq = self.backward
    return dataclasses.replace(self, block_q_dkv=q_dkv, block_k_dkv=k_dkv, block_q_dq=q_dq, block_k_dq=k_dq)

  def validate(self, backend: str, *, backward: bool = True) -> "BlockSizes":
    """Check the backend's constraints (of the backward tiles too unless `backward=False`); returns the
    resolved sizes.

    gpu (Triton): every tile a power of two >= 16 (tensor sizes must be powers of two; tl.dot needs 16).
    tpu (Mosaic): query tiles multiples of 8 (sublanes), key tiles multiples of 128 (lanes of the score
    tile); the dK/dV query tile is also a lane dimension (of the transposed probabilities), so 128 too.
    """
    sizes = self.resolved()
    if backend == "gpu":
      rules = dict.fromkeys(_FIELDS, 16)
    elif backend == "tpu":
      rules = {"block_q": 8, "block_k": 128, "block_q_dkv": 128, "block_k_dkv": 128, "block_q_dq": 8,
               "block_k_dq": 128}
    else:
      raise ValueError(f"backend must be 'gpu' or 'tpu', got {backend!r}")
    for name in _FIELDS if backward else _FIELDS[:2]:
      value, multiple = getattr(sizes, name), rules[name]
      what = f"BlockSizes.{name}={value}"
      if getattr(self, name) is None:
        what = f"BlockSizes.{name} (unset, so {value} from block_{name[6]})"
      if backend == "gpu" and (value < 16 or value & (value - 1)):
        raise ValueError(f"{what}: the GPU (Triton) kernels need a power of two >= 16")
      if backend == "tpu" and value % multiple:
        raise ValueError(f"{what}: the TPU (Mosaic) kernels need a multiple of {multiple}")
    return sizes


def fit_block(block: int, length: int, backend: str, axis: str) -> int:
  """The tile actually used for a sequence of `length`: `block`, shrunk for short sequences.

  axis "q" (sublane / row dimension) or "k" (lane dimension of the score tile, TPU only differs).
  """
  if backend == "gpu":
    return min(block, next_pow2(max(length, 16)))
  return min(block, round_up(length, 128 if axis == "k" else 8))
