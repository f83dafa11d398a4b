"""FLOPs and bytes of one decode forward, from the target compiler's own cost analysis of the compiled program.

Three things stand between `compiled.cost_analysis()` and a cost per forward, each handled here:
- Depth: compiling 32 layers is slow, and XLA's cost analysis counts a while-loop body once, whatever its trip
  count. So each program is compiled at 2 and 3 layers with every scan unrolled (`unrolled_scans`) and
  extrapolated: cost(L) = c2 + (L - 2) (c3 - c2). Not from 1 layer: the compiler treats a one-layer model
  differently (H100, LLaDA AR step at batch 1: +1.04 GB from layer 1 to 2, then +0.74 GB for each of
  layers 3, 4 and 5), while from 2 layers on every layer adds the same.
- Opaque kernels: a Pallas call is a custom call (Mosaic `tpu_custom_call`, Triton `__gpu$xla.gpu.triton`) whose
  FLOPs the compiler reports as ~0 and whose bytes it guesses from the operands (the whole stacked cache
  buffer, though the kernel reads one layer up to cache_len). Each layer's kernel call is therefore also
  compiled alone, with the same shapes (the cache stacked over the same 2 or 3 layers) and shardings,
  extrapolated like the program and subtracted; the attention formula (model.attention_cost) is added.
- In-place cache writes: the forward's KV cache write is a scatter of the window's rows into the donated
  stacked cache, done in place, but the cost analysis counts the whole cache read and written (1 GB per
  LLaDA layer at batch 32, cache 1024, for a 1-token AR step). The write is compiled alone too, at 2 and 3
  layers, and subtracted; the formula's bytes (the rows written) are added (model.cache_write_formula).
- The embedding gather: the cost analysis charges a gather its whole operand, the embedding table (1.04 GB for
  LLaDA-8B) for a few rows. It is compiled alone (the table sharded as the model's, the forward's token ids)
  and subtracted; the formula's bytes (the rows read and written) are added (model.gather_cost).
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
from d2f_jax.decode.forward_probes import StepShape, forward_probe
from d2f_jax.kernels.sharded import plan_heads
from d2f_jax.sharding import mesh_layout

# Bumped whenever the compiled programs or this accounting change: cached costs of another version are stale.
# 2: cached forwards unroll their layers and the window kernel reads the stacked cache; 3: cache writes apart;
# 4: extrapolated from 2 and 3 layers; 5: decode forwards with q/k/v from separate operands and the cache
# write after the last cache read (no copied q/k/v or cache slices); 6: projections stored [in, out] (no o copy)
# and the embedding gather charged as the rows it reads.
COST_VERSION = 6
FIT_LAYERS = (2, 3)  # the depths compiled; cost(L) is the line through them

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
    program = forward_probe(config.replace(num_layers=layers), shape, mesh=mesh)
    compiled, seconds = _compile(program.lower)
  return {**cost_of(compiled), "opaque": opaque_calls(compiled), "compile_s": round(seconds, 2)}


def _kernel_args(config, shape: StepShape, mesh, layers: int) -> tuple[tuple, tuple]:
  """Abstract arguments of one layer's attention call of `shape`, sharded as the model's own call is (the
  cache stacked over `layers` layers, as a cached forward of that depth passes it)."""
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
  cache = arg((layers, rows, size, k, d), P(None, batch, None, kv_heads, None))
  return (q, kv, kv, ids, ids, cache, cache, arg((rows, size), P(batch, None), jnp.int32),
          arg((rows,), P(batch), jnp.int32)), layout


def kernel_cost(config, shape: StepShape, mesh, layers: int = 1) -> dict:
  """What the compiler counts for one layer's attention call alone (the kernel plus its reshapes) in a
  forward of `layers` layers."""
  args, layout = _kernel_args(config, shape, mesh, layers)
  impl = config.attention_impl

  def one_layer(*a):
    with mesh_layout(layout):
      if shape.kind == "full_step":
        return kernels.attend(*a, impl=impl)
      return kernels.attend_window(*a, layer=0, impl=impl)
  compiled, seconds = _compile(lambda: jax.jit(one_layer).lower(*args))
  return {**cost_of(compiled), "opaque": opaque_calls(compiled), "compile_s": round(seconds, 2)}


def compiled_cache_write(config, shape: StepShape, mesh, layers: int) -> dict:
  """What the compiler counts for a cached forward's KV cache write alone (the window's K/V scattered into the
  donated cache of `layers` layers, sharded as the loop state is)."""
  from d2f_jax.decode.mesh import as_decode_mesh
  from d2f_jax.models import KVCache
  from d2f_jax.models.kv_cache import cache_specs
  placement = as_decode_mesh(mesh)
  layout, rows = placement.layout, placement.padded_batch(shape.batch)
  size, n = shape.prompt + shape.new_tokens, shape.tokens

  def write(cache, k, v, ids, count):
    with mesh_layout(layout):
      return cache.constrain(layout).write(k, v, ids, count).constrain(layout)
  specs = cache_specs(layout, rows, config.num_kv_heads)  # as the loop state holds the cache

  def arg(dims, spec, dtype):
    return jax.ShapeDtypeStruct(dims, dtype, sharding=NamedSharding(mesh, spec))
  stacked = lambda length: arg((layers, rows, length, config.num_kv_heads, config.head_dim), specs.k,
                               jnp.dtype(config.dtype))  # [L, B, S or T, K, D]
  cache = KVCache(k=stacked(size), v=stacked(size), ids=arg((rows, size), specs.ids, jnp.int32),
                  length=arg((rows,), specs.length, jnp.int32))
  args = (cache, stacked(n), stacked(n), arg((rows, n), specs.ids, jnp.int32), arg((rows,), specs.length, jnp.int32))
  compiled, seconds = _compile(lambda: jax.jit(write, donate_argnums=0).lower(*args))
  return {**cost_of(compiled), "compile_s": round(seconds, 2)}


def gather_cost(config, shape: StepShape, mesh) -> dict:
  """What the compiler counts for a forward's embedding gather alone: the forward's token ids' rows of the
  table, sharded as the model's parameter, cast to the compute dtype and laid out over the rows as the
  model's first activation."""
  from d2f_jax.decode.mesh import as_decode_mesh
  from d2f_jax.sharding import constrain_batch, logical_spec
  placement = as_decode_mesh(mesh)
  layout, rows = placement.layout, placement.padded_batch(shape.batch)
  table_spec = logical_spec(("vocab", "embed"), placement.rules, mesh, (config.vocab_size, config.embed_dim))

  def gather(table, tokens):
    with mesh_layout(layout):
      return constrain_batch(table.astype(jnp.dtype(config.dtype))[tokens])
  args = (jax.ShapeDtypeStruct((config.vocab_size, config.embed_dim), jnp.dtype(config.param_dtype),
                               sharding=NamedSharding(mesh, table_spec)),
          jax.ShapeDtypeStruct((rows, shape.tokens), jnp.int32, sharding=placement.rows(2)))
  compiled, seconds = _compile(lambda: jax.jit(gather).lower(*args))
  return {**cost_of(compiled), "compile_s": round(seconds, 2)}


def compiled_forward(config, shape: StepShape, mesh, log=print) -> dict:
  """Per-device compiled cost of one forward of the full-depth model: 'flops' / 'bytes' as the compiler counts
  them at FIT_LAYERS layers, extrapolated to config.num_layers, and 'kernel' (per layer: the attention calls'
  count, compiled alone and extrapolated the same way, over num_layers; to be replaced by the formula where
  'opaque' lists custom calls), 'write' (the cache write's count at full depth) and 'gather' (the embedding
  gather's count), each to be replaced likewise."""
  lo, hi = FIT_LAYERS
  layers = config.num_layers
  if layers < lo:
    raise ValueError(f"compiled_forward: {layers} layers is below the fitted depths {FIT_LAYERS}; compile it directly")

  def line(at_lo: dict, at_hi: dict) -> dict:
    """The count at `layers` on the line through the counts at lo and hi layers."""
    return {k: at_lo[k] + (layers - lo) * (at_hi[k] - at_lo[k]) / (hi - lo) for k in ("flops", "bytes")}
  first, second = program_cost(config, shape, mesh, lo), program_cost(config, shape, mesh, hi)
  out = line(first, second)
  out.update(opaque=second["opaque"], compile_s=round(first["compile_s"] + second["compile_s"], 2),
             layer={k: (second[k] - first[k]) / (hi - lo) for k in ("flops", "bytes")})
  if out["opaque"]:
    k_lo, k_hi = kernel_cost(config, shape, mesh, lo), kernel_cost(config, shape, mesh, hi)
    # Each call's count grows with the stack it is handed, so the line runs through the calls' totals.
    total = line({k: lo * k_lo[k] for k in ("flops", "bytes")}, {k: hi * k_hi[k] for k in ("flops", "bytes")})
    out["kernel"] = {k: total[k] / layers for k in ("flops", "bytes")}
    out["kernel"].update(opaque=k_hi["opaque"], compile_s=round(k_lo["compile_s"] + k_hi["compile_s"], 2))
  else:
    out["kernel"] = {"flops": 0.0, "bytes": 0.0, "opaque": []}
  if shape.kind != "full_step":  # every other forward writes the window's K/V into the cache
    out["write"] = line(compiled_cache_write(config, shape, mesh, lo), compiled_cache_write(config, shape, mesh, hi))
  out["gather"] = {k: v for k, v in gather_cost(config, shape, mesh).items() if k in ("flops", "bytes")}
  log(f"  {shape.kind} width {shape.width} batch {shape.batch}: compiled in {out['compile_s']:.1f}s"
      f"{' (+ kernel alone ' + str(out['kernel']['compile_s']) + 's)' if out['opaque'] else ''}")
  return out
