"""Bytes a compiled decode step moves without need: copies of weight or KV-cache slices in its optimized module.

A decode step is memory-bound: it should read each layer's weights and cache slice once, in place. When the
compiler cannot feed a slice of a stacked `[L, ...]` array to its consumer (a merged matmul over
concatenated q/k/v slices, a split-K regrouping, a cache write scheduled before a read of the old cache), it
materializes a copy first, and the step pays that traffic again. The instrument is the optimized HLO itself
(the compilers' byte counts are not trusted on every target): every top-level instruction of the entry
computation that reads a weight or cache parameter and is not a matmul, a kernel call or an in-place cache
update is a copy, and its output size is what it moved.
"""

from __future__ import annotations

import dataclasses
import re

_DTYPE_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "f64": 8, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1,
                "s64": 8, "u64": 8, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2}
_ARRAY = re.compile(r"\b(\w+)\[([\d,]*)\]")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?(%[\w.\-]+) = (.+?) (\w[\w\-]*)\((.*?)\)(?:, |$)")
# Entry parameters of a step program: its stacked layer weights and its KV cache (jit argument paths).
_SOURCES = re.compile(r"(layers|cache_k|cache_v)")
# Ops that read a source legitimately: matmuls (cuBLAS / Triton gemm fusions, dots), kernel calls, and the
# views that cost nothing.
_READERS = ("dot", "convolution", "custom-call", "bitcast", "get-tuple-element", "tuple", "parameter")
_IN_PLACE_ROOTS = ("dynamic-update-slice", "scatter")  # the cache write into the donated cache


@dataclasses.dataclass(frozen=True)
class Copy:
  instruction: str  # its name in the optimized module
  op: str  # opcode (fusion kind for fusions)
  source: str  # the weight or cache parameter it reads
  bytes: int  # what it writes


def _bytes(shape_text: str) -> int:
  total = 0
  for dtype, dims in _ARRAY.findall(shape_text):
    n = _DTYPE_BYTES.get(dtype, 4)
    for d in filter(None, dims.split(",")):
      n *= int(d)
    total += n
  return total


def _computations(text: str) -> dict[str, list[str]]:
  """Named computations of an HLO module's text -> their instruction lines."""
  out, name = {}, None
  for line in text.splitlines():
    header = re.match(r"^(?:ENTRY )?(%[\w.\-]+) .*\{\s*$", line)
    if header:
      name = "ENTRY" if line.startswith("ENTRY") else header.group(1)
      out[name] = []
    elif line.startswith("}"):
      name = None
    elif name is not None:
      out[name].append(line)
  return out


def _root_op(lines: list[str]) -> str:
  for line in lines:
    if line.lstrip().startswith("ROOT"):
      m = _INSTRUCTION.match(line)
      return m.group(3) if m else ""
  return ""


def _called_ops(line: str, computations: dict[str, list[str]]) -> set[str]:
  """Opcodes inside the computation a fusion calls."""
  called = re.search(r"calls=(%[\w.\-]+)", line)
  ops = set()
  for inner in computations.get(called.group(1), []) if called else []:
    m = _INSTRUCTION.match(inner)
    if m:
      ops.add(m.group(3))
  return ops


def _loop_copies(hlo_text: str, computations: dict[str, list[str]], min_bytes: int) -> list[Copy]:
  """Slices a layer loop's body materializes: a top-level dynamic-slice, or a fusion that slices without a
  matmul in it (a matmul or kernel reading the stacked array at the loop's counter reads it in place)."""
  found = []
  for body in sorted(set(re.findall(r"body=(%[\w.\-]+)", hlo_text))):
    for line in computations.get(body, []):
      m = _INSTRUCTION.match(line)
      if not m:
        continue
      name, shape, op, _ = m.groups()
      size = _bytes(shape)
      if size < min_bytes:
        continue
      if op == "fusion":
        ops = _called_ops(line, computations)
        if "dynamic-slice" not in ops or ops & {"dot", "convolution", "custom-call"}:
          continue
        kind = re.search(r"kind=(\w+)", line)
        found.append(Copy(name.lstrip("%"), kind.group(1) if kind else "fusion", "loop body slice", size))
      elif op == "dynamic-slice":
        found.append(Copy(name.lstrip("%"), op, "loop body slice", size))
  return found


def copied_slices(hlo_text: str, min_bytes: int = 1 << 20) -> list[Copy]:
  """Copies of weight / cache slices of at least `min_bytes` in an optimized module's text: at the entry
  computation's top level (a decode step with its layers unrolled) and in while-loop bodies (a layer scan,
  where the source is named "loop body slice")."""
  computations = _computations(hlo_text)
  entry = computations.get("ENTRY", [])
  sources = {}  # parameter -> bytes of one layer's slice (the stacks lead with their layers axis)
  for line in entry:
    m = _INSTRUCTION.match(line)
    if m and m.group(3) == "parameter" and _SOURCES.search(m.group(1)):
      dims = [int(d) for d in filter(None, _ARRAY.search(m.group(2)).group(2).split(","))]
      sources[m.group(1)] = _bytes(m.group(2)) // max(dims[0] if dims else 1, 1)
  found = []
  for line in entry:
    m = _INSTRUCTION.match(line)
    if not m:
      continue
    name, shape, op, operands = m.groups()
    if op in _READERS:
      continue
    # A weight or cache slice big enough to matter (a bias beside activations is not a copy of it)
    read = sorted((sources[o], o) for o in re.findall(r"%[\w.\-]+", operands) if o in sources)
    if not read or read[-1][0] < min_bytes:
      continue
    kind = op
    if op == "fusion":
      kind_match = re.search(r"kind=(\w+)", line)
      kind = kind_match.group(1) if kind_match else "fusion"
      called = re.search(r"calls=(%[\w.\-]+)", line)
      if kind == "kCustom" or (called and _root_op(computations.get(called.group(1), [])) in _IN_PLACE_ROOTS):
        continue  # a gemm fusion reading the slice in place, or the cache's in-place update
    size = _bytes(shape)
    if size >= min_bytes:
      found.append(Copy(name.lstrip("%"), kind, read[-1][1].lstrip("%"), size))
  return found + _loop_copies(hlo_text, computations, min_bytes)
