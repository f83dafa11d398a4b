"""Per-device memory of a compiled program, from the compiler's own memory analysis, against the device's HBM.

`memory_analysis()` of a compiled executable gives the bytes one device holds: its arguments, outputs,
temporaries and generated code, less what outputs alias from donated arguments. That is what the target's
compiler planned (the TPU compiler's when compiled for a TPU topology, XLA:GPU's for an NVIDIA target), not
an estimate; `argument_bytes` of the abstract inputs cross-checks the argument part exactly.
"""

from __future__ import annotations

import math
import re

GiB = 1 << 30
FIELDS = ("arguments", "outputs", "aliased", "temporaries", "generated_code")


def argument_bytes(tree) -> int:
  """Bytes one device holds of a tree of sharded ShapeDtypeStructs (shard shapes, so replication counts)."""
  import jax
  total = 0
  for leaf in jax.tree.leaves(tree):
    if not hasattr(leaf, "dtype"):
      continue  # a static argument (the serving programs' context) holds no device bytes
    sharding = getattr(leaf, "sharding", None)
    shape = sharding.shard_shape(leaf.shape) if sharding is not None else leaf.shape
    total += math.prod(shape) * leaf.dtype.itemsize  # PRNG key dtypes have one too
  return total


def compiled_memory(compiled) -> dict[str, int] | None:
  """{arguments, outputs, aliased, temporaries, generated_code, total} bytes per device, or None when the
  backend has no memory analysis. total = arguments + outputs - aliased + temporaries + generated code."""
  stats = compiled.memory_analysis()
  if stats is None:
    return None
  get = lambda name: int(getattr(stats, name, 0) or 0)  # noqa: E731
  out = {"arguments": get("argument_size_in_bytes"), "outputs": get("output_size_in_bytes"),
         "aliased": get("alias_size_in_bytes"), "temporaries": get("temp_size_in_bytes"),
         "generated_code": get("generated_code_size_in_bytes")}
  out["total"] = out["arguments"] + out["outputs"] - out["aliased"] + out["temporaries"] + out["generated_code"]
  return out


_HLO_SHAPE = re.compile(r"\b(pred|s4|u4|s8|u8|s16|u16|s32|u32|s64|u64|f8e4m3fn|f8e5m2|f16|bf16|f32|f64)\[([0-9,]*)\]")
_HLO_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2,
              "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}


def largest_arrays(hlo_text: str, top: int) -> list[tuple[str, int]]:
  """The `top` largest distinct array shapes of a compiled (per-device) HLO module with their bytes: where the
  memory goes, e.g. activations whose batch is less sharded than the mesh allows."""
  sizes = {}
  for dtype, dims in _HLO_SHAPE.findall(hlo_text):
    shape = f"{dtype}[{dims}]"
    if shape not in sizes:
      sizes[shape] = int(math.prod(int(d) for d in dims.split(",") if d) * _HLO_BYTES[dtype])
  return sorted(sizes.items(), key=lambda kv: -kv[1])[:top]


def size(n: int | float | None) -> str:
  if n is None:
    return "-"
  for unit, scale in (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
    if abs(n) >= scale:
      return f"{n / scale:.2f} {unit}"
  return f"{int(n)} B"


def format_report(report: dict) -> str:
  """Human-readable lines of one check's report (see check.compile_program)."""
  lines = [f"{report['program']} {report['model']} ({report['dtype']}, attention {report['attention_impl']}) on "
           f"{report['target']}: {report['devices']} x {report['device_kind']}, mesh {report['mesh']}; "
           + ", ".join(f"{k} {v}" for k, v in report["shape"].items())]
  compiled = report.get("compiled")
  if compiled:
    lines.append("  per device: " + ", ".join(f"{k} {size(compiled[k])}" for k in FIELDS)
                 + f" -> total {size(compiled['total'])}")
  else:
    lines.append(f"  per device: arguments {size(report['argument_bytes'])} (not compiled: no memory analysis)")
  if report.get("largest_arrays"):
    lines.append("  largest arrays: " + ", ".join(f"{shape} {size(n)}" for shape, n in report["largest_arrays"]))
  if "fits" in report:
    need, hbm = report["needed_bytes"], report["hbm_bytes"]
    lines.append(f"  needs {size(need)} of {size(hbm)} HBM ({100 * need / hbm:.0f}%, usable "
                 f"{size(report['usable_bytes'])}): {'fits' if report['fits'] else 'DOES NOT FIT'}; "
                 f"lowered in {report['lower_s']:.1f}s, compiled in {report.get('compile_s', 0.0):.1f}s")
  return "\n".join(lines)
