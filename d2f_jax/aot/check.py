"""Lower and compile one program for a target, and judge its per-device memory against the device's HBM."""

from __future__ import annotations

import time

from d2f_jax.aot import memory
from d2f_jax.aot.programs import Program
from d2f_jax.aot.topology import Topology


def compile_program(program: Program, topology: Topology, devices: list, *, model: str, dtype: str,
                    attention_impl: str, compile: bool = True, top: int = 0, log=print) -> dict:
  """The report of one compile: memory per device from the compiler, compile seconds, and whether it fits
  (needed = the compiler's total, or without a compile the arguments alone, a lower bound)."""
  report = {"program": program.name, "model": model, "dtype": dtype, "attention_impl": attention_impl,
            "target": topology.name, "kind": topology.kind, "platform": topology.platform,
            "devices": len(devices), "device_kind": str(devices[0].device_kind), "mesh": program.mesh,
            "shape": program.shape, "argument_bytes": memory.argument_bytes(program.args)}
  t0 = time.perf_counter()
  lowered = program.lower()
  report["lower_s"] = round(time.perf_counter() - t0, 2)
  log(f"  {program.name}: lowered in {report['lower_s']:.1f}s")
  report["compiled"] = None
  if compile:
    t0 = time.perf_counter()
    compiled = lowered.compile()
    report["compile_s"] = round(time.perf_counter() - t0, 2)
    log(f"  {program.name}: compiled in {report['compile_s']:.1f}s")
    report["compiled"] = memory.compiled_memory(compiled)
    if top:
      report["largest_arrays"] = memory.largest_arrays(compiled.as_text() or "", top)
  need = (report["compiled"] or {}).get("total") or report["argument_bytes"]
  report.update(needed_bytes=need, hbm_bytes=topology.hbm_bytes, usable_bytes=topology.usable_bytes,
                fits=need <= topology.usable_bytes)
  return report
