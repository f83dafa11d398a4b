"""Accelerator peaks from the vendors' data sheets, in one place (datasheets.json) for the attention
benchmark's roofline and the miniature's 8B projection."""

from __future__ import annotations

import dataclasses
import functools
import json
import os


@dataclasses.dataclass(frozen=True)
class Datasheet:
  name: str
  bf16_tflops: float  # dense bf16 peak, TFLOP/s
  hbm_gbps: float  # HBM bandwidth, GB/s


@functools.lru_cache(maxsize=None)
def _rows() -> tuple[tuple[str, Datasheet], ...]:
  with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "datasheets.json")) as f:
    rows = json.load(f)["devices"]
  return tuple((r["match"], Datasheet(r["name"], float(r["bf16_tflops"]), float(r["hbm_gbps"]))) for r in rows)


def for_device_kind(device_kind: str) -> Datasheet | None:
  """The data sheet of a jax device_kind ("NVIDIA H100 80GB HBM3", "TPU v5p"), None for an unknown one."""
  kind = device_kind.lower()
  return next((sheet for match, sheet in _rows() if match in kind), None)


def by_name(name: str) -> Datasheet:
  """The data sheet named `name` ("H100 SXM", "TPU v5p")."""
  for _, sheet in _rows():
    if sheet.name == name:
      return sheet
  raise KeyError(f"no data sheet named {name!r}; known: {sorted({s.name for _, s in _rows()})}")
