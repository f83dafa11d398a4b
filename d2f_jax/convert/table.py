"""The rows of the name / layout tables (convert/families.py): how one Hugging Face tensor shows one (or,
fused, several) of our parameters.

A transform is a *view*: `hf_view(ours)` shows a (per-layer slice of a) parameter of ours in the HF layout,
so import writes through the view and export copies out of it; the two directions cannot disagree.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from d2f_jax.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Transform:
  """`kind`: 'identity' (same shape), 'flatten' (HF keeps it 1-D) or 'linear' (HF [out, in] = ours
  reshaped to [in, out] and transposed; the first `n_in` axes of ours are the input axes)."""
  kind: str
  n_in: int = 1

  def hf_shape(self, ours: tuple[int, ...]) -> tuple[int, ...]:
    if self.kind == "identity":
      return tuple(ours)
    if self.kind == "flatten":
      return (math.prod(ours),)
    return (math.prod(ours[self.n_in:]), math.prod(ours[:self.n_in]))

  def hf_view(self, ours: np.ndarray) -> np.ndarray:
    """A view (never a copy) of `ours` in the HF layout; `ours` must be C-contiguous."""
    if not ours.flags.c_contiguous:
      raise ValueError(f"hf_view needs a C-contiguous array, got strides {ours.strides}")
    if self.kind == "identity":
      return ours
    if self.kind == "flatten":
      return ours.reshape(-1)
    n_in = math.prod(ours.shape[:self.n_in])
    return ours.reshape(n_in, -1).T


IDENTITY = Transform("identity")
FLATTEN = Transform("flatten")
LINEAR = Transform("linear", n_in=1)  # ours [in, out] e.g. q [E, H*D], gate [E, F]


@dataclasses.dataclass(frozen=True)
class Row:
  hf: str  # HF tensor name; '{i}' marks a per-layer tensor, '{j}' a per-expert one
  ours: str | tuple[str, ...]  # our parameter path ('{stack}': the layer's stack); several: HF fuses them by rows
  transform: Transform
  when: str | None = None  # present only for some configs or layers: see `applies`

  @property
  def per_layer(self) -> bool:
    return "{i}" in self.hf

  @property
  def paths(self) -> tuple[str, ...]:
    return (self.ours,) if isinstance(self.ours, str) else self.ours

  def applies(self, config: ModelConfig, layer: int | None = None) -> bool:
    """Whether a checkpoint of `config` holds this tensor (in `layer`, for a per-layer row)."""
    moe_layer = config.moe is not None and layer is not None and layer >= config.dense_layers
    return {"qkv_bias": config.qkv_bias, "untied": not config.tie_embeddings, "qk_norm": config.qk_norm,
            "dense": not moe_layer, "moe": moe_layer, "expert_bias": moe_layer and config.moe.expert_bias,
            "shared": moe_layer and bool(config.moe.num_shared_experts), None: True}[self.when]


@dataclasses.dataclass(frozen=True)
class FamilyTable:
  family: str
  rows: tuple[Row, ...]
  peft_prefix: str = "base_model.model."  # PEFT wraps the whole model: base_model.model.<module path>

  def has_module(self, target: str) -> bool:
    """Whether LoRA target `target` ('q') is a Linear of its own in every layer of this family's checkpoints
    (not for LLaDA2: q / k / v are one fused Linear and the MLPs differ between dense and expert layers)."""
    return any(row.paths == (f"layers/{target}",) for row in self.rows)

  def module(self, target: str) -> str:
    """HF module path ('...{i}.q_proj') of one of our LoRA targets ('q')."""
    for row in self.rows:
      if row.paths == (f"layers/{target}",):
        return row.hf[:-len(".weight")]
    raise KeyError(f"{self.family} has no module of its own for LoRA target {target!r}")

  def peft_target(self, target: str) -> str:
    """PEFT's target_modules name of one of our targets ('o' -> 'attn_out' / 'o_proj')."""
    return self.module(target).rsplit(".", 1)[-1]
