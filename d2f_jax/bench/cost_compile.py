"""FLOPs and bytes of one decode forward, from the target compiler's own cost analysis of the compiled program.

Three things stand between `compiled.cost_analysis()` and a cost per forward, each handled here:
- Loops: XLA's cost analysis counts a while-loop body once, whatever its trip count, and the layers are a
  `lax.scan`. So each program is compiled at 1 and 2 layers with every scan unrolled (`unrolled_scans`) and
  extrapolated: cost(L) = c1 + (L - 1) (c2 - c1), exact because every layer is the same scanned body.
- Opaque kernels: a Pallas call is a custom call (Mosaic `tpu_custom_call`, Triton `__gpu$xla.gpu.triton`) whose
  FLOPs the compiler reports as ~0 and whose bytes it guesses from the operands (the whole cache buffer, though
  the kernel stops at cache_len). Each layer's kernel call is therefore also compiled alone, with the same
  shapes and shardings, and subtracted; the attention formula (cost_model.attention_cost) is added instead.
- NVIDIA targets: the deviceless compile has no cost analysis ("GetCostAnalysis is not supported"), so XLA's
  HloCostAnalysis is run on the compiled (optimized, fused) HLO module it does return.
All numbers are per device (the SPMD-partitioned module) for the target's decode mesh.
"""

from __future__ import annotations

import contextlib
import re
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from d2f_jax import kernels
from d2f_jax.decode.step_programs import StepShape, step_program
from d2f_jax.kernels.sharded import plan_heads
from d2f_jax.sharding import mesh_layout

# Custom-call targets of Pallas kernels, whose cost the compiler cannot see.
OPAQUE_CALLS = ("tpu_custom_call", "__gpu$xla.gpu.triton", "mosaic_gpu")
_CALL = re.compile(r'custom_call_target="([^"]+)"')


@contextlib.contextmanager
def unrolled_scans():
  """Trace with every `jax.lax.scan` unrolled, so no loop hides iterations from the cost analysis."""
  original = jax.lax.scan

  def scan(*args, **kwargs):
    kwargs["unroll"] = True
    return original(*args, **kwargs)
  jax.lax.scan = scan
  try:
    yield
  finally:
    jax.lax.scan = original


def cost_of(compiled) -> dict[str, float]:
  """{'flops', 'bytes'} per device of a compiled program: the backend's cost analysis, else (NVIDIA's
  deviceless compile) XLA's HloCostAnalysis of the optimized module."""
  try:
    analysis = compiled.cost_analysis()
  except Exception:  # noqa: BLE001 - backends raise different types for "unimplemented"
    analysis = None
  if isinstance(analysis, (list, tuple)):
    analysis = analysis[0] if analysis else None
  if not analysis:
    from jax._src import xla_bridge
    from jax._src.lib import _jax
    module = compiled.runtime_executable().hlo_modules()[0]
    analysis = _jax.hlo_module_cost_analysis(xla_bridge.get_backend("cpu"), module)
  return {"flops": float(analysis.get("flops", 0.0)), "bytes": float(analysis.get("bytes accessed", 0.0))}


def opaque_calls(compiled) -> list[str]:
  """The Pallas custom-call targets in a compiled program (empty: the compiler saw every op)."""
  found = set(_CALL.findall(compiled.as_text() or ""))
  return sorted(t for t in found if any(t.startswith(o) for o in OPAQUE_CALLS))


def _compile(lowered_fn) -> tuple[object, float]:
  start = time.perf_counter()
  compiled = lowered_fn().compile()
  return compiled, time.perf_counter() - start


def program_cost(config, shape: StepShape, mesh, layers: int) -> dict:
  """The compiled cost of `shape`'s forward for `config` cut to `layers` layers (scans unrolled)."""
  with unrolled_scans():
    program = step_program(config.replace(num_layers=layers), shape, mesh=mesh)
    compiled, seconds = _compile(program.lower)
  return {**cost_of(compiled), "opaque": opaque_calls(compiled), "compile_s": round(seconds, 2)}


def _kernel_args(config, shape: StepShape, mesh) -> tuple[tuple, tuple]:
  """Abstract arguments of one layer's attention call of `shape`, sharded as the model's own call is."""
  from d2f_jax.decode.mesh import as_decode_mesh
  layout = as_decode_mesh(mesh).layout
  rows = as_decode_mesh(mesh).padded_batch(shape.batch)
  split = plan_heads(config.num_heads, config.num_kv_heads, layout.head_size())
  batch = layout.batch_split(rows) or None
  heads = layout.head_axis if split.shards > 1 else None
  kv_heads = heads if split.kv_split else None
  dtype = jnp.dtype(config.dtype)
  n, h, k, d = shape.tokens, config.num_heads, config.num_kv_heads, config.head_dim

  def arg(dims, spec, dt=dtype):
    return jax.ShapeDtypeStruct(dims, dt, sharding=NamedSharding(mesh, spec))
  q = arg((rows, n, h, d), P(batch, None, heads, None))
  kv = arg((rows, n, k, d), P(batch, None, kv_heads, None))
  ids = arg((rows, n), P(batch, None), jnp.int32)
  if shape.kind == "full_step":
    return (q, kv, kv, ids, ids), layout
  size = shape.prompt + shape.new_tokens
  cache = arg((rows, size, k, d), P(batch, None, kv_heads, None))
  return (q, kv, kv, ids, ids, cache, cache, arg((rows, size), P(batch, None), jnp.int32),
          arg((rows,), P(batch), jnp.int32)), layout


def kernel_cost(config, shape: StepShape, mesh) -> dict:
  """What the compiler counts for one layer's attention call alone (the kernel plus its reshapes)."""
  args, layout = _kernel_args(config, shape, mesh)
  impl = config.attention_impl

  def one_layer(*a):
    with mesh_layout(layout):
      if shape.kind == "full_step":
        return kernels.attend(*a, impl=impl)
      return kernels.attend_window(*a, impl=impl)
  compiled, seconds = _compile(lambda: jax.jit(one_layer).lower(*args))
  return {**cost_of(compiled), "opaque": opaque_calls(compiled), "compile_s": round(seconds, 2)}


def forward_cost(config, shape: StepShape, mesh, log=print) -> dict:
  """Per-device compiled cost of one forward of the full-depth model: 'flops' / 'bytes' as the compiler counts
  them at 1 and 2 layers, extrapolated to config.num_layers, and 'kernel' (per layer, counted by the compiler
  for the attention call alone; to be replaced by the formula where 'opaque' lists custom calls)."""
  one, two = program_cost(config, shape, mesh, 1), program_cost(config, shape, mesh, 2)
  extra = config.num_layers - 1
  out = {k: one[k] + extra * (two[k] - one[k]) for k in ("flops", "bytes")}
  out.update(opaque=two["opaque"], compile_s=round(one["compile_s"] + two["compile_s"], 2),
             layer={k: two[k] - one[k] for k in ("flops", "bytes")})
  out["kernel"] = kernel_cost(config, shape, mesh) if out["opaque"] else {"flops": 0.0, "bytes": 0.0, "opaque": []}
  log(f"  {shape.kind} width {shape.width} batch {shape.batch}: compiled in {out['compile_s']:.1f}s"
      f"{' (+ kernel alone ' + str(out['kernel']['compile_s']) + 's)' if out['opaque'] else ''}")
  return out
