"""From per-forward costs to ms per forward, and from ms per forward to projected tokens/s.

Formulas (bf16, per device of a mesh with `tensor` head shards and `data` row shards; b = rows per device):
  attention  FLOPs = 4 b n (c + n) H' D L              (QK^T and PV of n queries over c cached + n window keys)
             bytes = 2 b L (2 c K' D + 2 n H' D + 2 n K' D)   (K/V of c cached tokens, q / out, window k / v)
  whole      e2e.projection.roofline_forward of the b rows (weights once, or a mixture of experts' chosen ones,
             n embedding rows and K/V of c cached per row), / tensor
  time       max(FLOPs / peak, bytes / HBM bandwidth)  (data sheet; collectives and launch overhead left out)
H' = H / tensor, K' the kv heads a shard reads (kernels.sharded.plan_heads). c = prompt + half the response
for a step (the mean cache length over a decode; the kernels read only up to it), 0 for a prefill or vanilla's
full forward (n attends to itself).
"""

from __future__ import annotations

import math

from d2f_jax.decode.forward_probes import StepShape
from d2f_jax.decode.widths import ms_at_width
from d2f_jax.e2e import projection
from d2f_jax.kernels.sharded import plan_heads

BYTES = 2  # bf16


def cached_tokens(shape: StepShape) -> float:
  """c: the cached tokens a forward of `shape` attends to (mean over the decode for a step)."""
  return shape.prompt + shape.new_tokens / 2 if shape.kind in ("d2f_step", "ar_step") else 0.0


def rows_per_device(batch: int, data: int) -> int:
  return -(-batch // data)


def attention_cost(config, shape: StepShape, mesh_shape: dict) -> dict[str, float]:
  """The formula's attention FLOPs and bytes of one forward, per device."""
  tensor = mesh_shape.get("tensor", 1)
  split = plan_heads(config.num_heads, config.num_kv_heads, tensor)
  h = config.num_heads // split.shards
  k = split.kv_local
  b, n, c = rows_per_device(shape.batch, mesh_shape.get("data", 1)), shape.tokens, cached_tokens(shape)
  d, layers = config.head_dim, config.num_layers
  flops = 4 * b * n * (c + n) * h * d * layers
  nbytes = BYTES * b * layers * (2 * c * k * d + 2 * n * h * d + 2 * n * k * d)
  return {"flops": float(flops), "bytes": float(nbytes)}


def formula_cost(config, shape: StepShape, mesh_shape: dict) -> dict[str, float]:
  """The hand-written roofline of one forward (e2e.projection.roofline_forward), per device."""
  tensor, b = mesh_shape.get("tensor", 1), rows_per_device(shape.batch, mesh_shape.get("data", 1))
  flops, nbytes = projection.roofline_forward(config, shape.tokens, cached_tokens(shape), rows=b)
  return {"flops": flops / tensor, "bytes": nbytes / tensor}


def cache_write_formula(config, shape: StepShape, mesh_shape: dict) -> dict[str, float]:
  """The formula's bytes of a cached forward's KV cache write, per device: the window's K and V read and
  written into their slots, L x b x n x K_stored x D each (kv heads stay replicated where tensor does not
  divide them, as KVCache.constrain keeps them)."""
  tensor = mesh_shape.get("tensor", 1)
  kv = config.num_kv_heads // tensor if config.num_kv_heads % tensor == 0 else config.num_kv_heads
  b = rows_per_device(shape.batch, mesh_shape.get("data", 1))
  return {"flops": 0.0, "bytes": float(BYTES * 2 * 2 * config.num_layers * b * shape.tokens * kv * config.head_dim)}


def gather_cost(config, shape: StepShape, mesh_shape: dict) -> dict[str, float]:
  """The formula's bytes of a forward's embedding gather, per device: b x n rows of E read and written in the
  compute dtype (the table is split over vocab: each device reads its own rows, the partial rows are summed)
  and the token ids."""
  b = rows_per_device(shape.batch, mesh_shape.get("data", 1))
  return {"flops": 0.0, "bytes": float(b * shape.tokens * (2 * BYTES * config.embed_dim + 4))}


def accounted_cost(compiled: dict, config, shape: StepShape, mesh_shape: dict) -> dict:
  """The compiled cost with what the compiler cannot count replaced by formulas: opaque attention kernels
  (the program less L x the kernel call compiled alone, + attention_cost), the in-place cache write (less
  the write compiled alone, + cache_write_formula) and the embedding gather (less the gather compiled alone, +
  gather_cost). Without any of them (XLA attention, no cache, costs of an older version) the count stands.
  Not corrected: a D2F step's two row gathers from its logits (decode/pipeline.py), each counted as the whole
  [b, n, V] array. Harmless to every packaged table (tests/test_bench_cost.py): at the largest compiled batch
  each D2F step is bound by its FLOPs, and at batch 1 the two arrays are under 2% of the step's bytes."""
  parts = []
  if compiled["opaque"]:
    parts.append(("attention formula", {k: config.num_layers * compiled["kernel"][k] for k in ("flops", "bytes")},
                  attention_cost(config, shape, mesh_shape)))
  if compiled.get("write"):
    parts.append(("cache-write formula", compiled["write"], cache_write_formula(config, shape, mesh_shape)))
  if compiled.get("gather"):
    parts.append(("embedding-gather formula", compiled["gather"], gather_cost(config, shape, mesh_shape)))
  out = {"source": " + ".join(["compiled"] + [name for name, _, _ in parts])}
  for key in ("flops", "bytes"):
    rest = compiled[key] - sum(counted[key] for _, counted, _ in parts)
    if parts:
      out[f"rest_{key}"] = rest
    out[key] = max(rest, 0.0) + sum(formula[key] for _, _, formula in parts)
  return out


def weights_per_device(config, mesh_shape: dict) -> float:
  """Bytes of the layer weights a token uses (a mixture of experts: its k experts) and the head, per device: a
  floor under any forward's traffic (each is read at least once; replicated parts only raise the real figure)."""
  return BYTES * (projection.layer_params(config) + config.embed_dim * config.vocab_size) / mesh_shape.get("tensor", 1)


def implausible_bytes(compiled: dict, accounted: dict, config, mesh_shape: dict) -> str | None:
  """Why a compiler's byte count cannot be HBM traffic (None when it can): negative, or the accounted
  forward moving fewer bytes than its own weights. libtpu's 'bytes accessed' fails this (v5e-8 LLaDA: 1.3 GB
  accounted for a D2F step whose weights are 1.9 GB per device, negative counts on Dream)."""
  floor = weights_per_device(config, mesh_shape)
  if compiled["bytes"] < 0:
    return f"the compiler counts {compiled['bytes'] / 1e9:.3g} GB"
  if accounted["bytes"] < floor:
    return f"{accounted['bytes'] / 1e9:.3g} GB accounted, under the {floor / 1e9:.3g} GB of weights per device"
  return None


def with_formula_bytes(accounted: dict, formula: dict) -> dict:
  """The compiled cost with the formula's bytes: its FLOPs still checked, its traffic from the roofline."""
  return {**accounted, "bytes": formula["bytes"], "source": accounted["source"] + "; bytes: formula"}


def milliseconds(cost: dict, sheet) -> float:
  """Roofline time of one forward: max(FLOPs / peak, bytes / bandwidth), in ms."""
  return 1000 * max(cost["flops"] / (sheet.bf16_tflops * 1e12), cost["bytes"] / (sheet.hbm_gbps * 1e9))


def falls_with_rows(points: dict[int, float]) -> bool:
  """Whether a per-forward cost is lower at the largest compiled batch than at the smallest: more rows never
  move fewer bytes or do less work, so such a count is not a model of the forward."""
  return points[max(points)] < points[min(points)]


def affine(points: dict[int, float], batch: float) -> float | None:
  """A per-forward quantity at `batch`, from its values at two or more compiled batches: affine in the rows
  (weights once per forward, everything else per row), fitted through the smallest and the largest. None
  when the cost falls as rows are added: not physical, so the compiler's count is not a traffic model there."""
  if len(points) == 1:
    raise ValueError(f"affine: need costs at two batches to fit, got only batch {list(points)}")
  if falls_with_rows(points):
    return None
  lo, hi = min(points), max(points)
  return points[lo] + (batch - lo) * (points[hi] - points[lo]) / (hi - lo)


def decode_ms(row: dict, ms: dict, new_tokens: int, block_size: int | None = None,
              batch: float = 1) -> float | None:
  """ms to generate `new_tokens` per row with a results row's measured tokens per forward (and window):
  prefill + (N / tokens_per_forward - 1) cached steps; vanilla: N / tokens_per_forward full forwards.
  `ms` maps 'd2f_step' {width: ms}, 'ar_step', 'full_step', 'd2f_prefill', 'ar_prefill' to ms at one batch;
  a prefill that was not compiled counts 0 (steady-state decoding), a step that was not makes it None.
  The window: the row's at `batch` (e2e.projection.window_blocks: measured positions over the compiled steps'
  `block_size` where both are known, a throughput mode's windows being neither whole blocks nor of the
  compiled block size; at a batch, as wide as the batch's widest row), else its `mean_window_blocks`."""
  tpf = row.get("tokens_per_forward")
  if not tpf:
    return None
  forwards = new_tokens / tpf
  method = row["method"]
  if method in ("vanilla", "dream_vanilla"):
    return forwards * ms["full_step"] if ms.get("full_step") else None
  if method == "ar":
    return (ms.get("ar_prefill") or 0.0) + (forwards - 1) * ms["ar_step"] if ms.get("ar_step") else None
  if not ms.get("d2f_step") or None in ms["d2f_step"].values():
    return None
  blocks = projection.window_blocks(row, block_size, batch)
  return (ms.get("d2f_prefill") or 0.0) + (forwards - 1) * ms_at_width(ms["d2f_step"], blocks)


def crossover(ratio, limit: int = 4096) -> str:
  """The smallest batch at which D2F / AR drops below 1 ('-' if D2F is never faster, '> limit' if never
  slower up to `limit`); ratio(batch) -> float."""
  if ratio(1) < 1:
    return "-"
  for batch in range(2, limit + 1):
    if ratio(batch) < 1:
      return str(batch)
  return f"> {limit}"


def fmt(value, digits: int = 3) -> str:
  if value is None or (isinstance(value, float) and math.isnan(value)):
    return ""
  return f"{value:.{digits}g}" if abs(value) < 10 ** digits else f"{value:.0f}"
