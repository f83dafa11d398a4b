"""No copied weight or KV-cache slice in the optimized decode steps: LLaDA-8B and Dream-7B (cut to 3 layers;
every layer compiles alike), the AR step and D2F steps at widths 2 and 3, batch 1 and 32, cache 1024
(prompt 768 + 256, block 32), compiled by the real compilers for H100 (Triton / cuBLAS) and v5e-8 / v5p-8
(libtpu, whose byte counts are not trusted: the module's instructions are the instrument).

What is still moved, and so left out of the check by name until it is removed (tracked in the issue on the
decode steps' roofline), on H100 only: Dream-7B's k and v at AR batch 1, a [1, E] x [E, 4 * 128] product small
enough for XLA to strength-reduce to multiply + reduce, whose product (the size of the layer's k / v slice) is
materialized. (o's layer slice, once [H, D, E], was copied for a split-K matmul; stored [H*D, E] it is read in
place.) On every target everything else must be read in place: the guard fails on any other copy over 1 MiB.

The scanned layer loop (`layer_loop="scan"`, compiled in a fraction of the time) is checked on TPU too: the
window kernel reads the stacked cache at the scan's counter in place, and libtpu copies at most the q and k
weight slices of a layer (to give their matmuls a head-major output), nothing else."""

import pytest

from d2f_jax.aot import topology as topo
from d2f_jax.bench.hlo_copies import copied_slices
from d2f_jax.decode.forward_probes import StepShape, forward_probe
from d2f_jax.models import preset



def _known(platform: str, model: str, kind: str, batch: int, copy) -> bool:
  """The open items above."""
  if platform != "cuda":
    return False
  return (model == "dream-7b" and kind == "ar_step" and batch == 1 and copy.op == "kLoop"
          and copy.source.startswith(("params__layers____k___value", "params__layers____v___value")))

SHAPES = [(kind, width, batch) for kind, width in (("ar_step", 1), ("d2f_step", 2), ("d2f_step", 3))
          for batch in (1, 32)]


@pytest.mark.parametrize("target", [pytest.param("h100", marks=pytest.mark.cuda),
                                    pytest.param("v5e-8", marks=pytest.mark.tpu),
                                    pytest.param("v5p-8", marks=pytest.mark.tpu)])
@pytest.mark.parametrize("model", ["llada-8b", "dream-7b"])
def test_decode_steps_copy_no_weight_or_cache_slice(target, model):
  from d2f_jax import sharding
  from d2f_jax.aot.programs import decode_mesh_shape
  t = topo.parse_target(target)
  topo.configure_jax(t.platform)
  devices = topo.devices(t)
  config = preset(model, dtype="bfloat16", param_dtype="bfloat16", attention_impl="pallas").replace(num_layers=3)
  mesh = sharding.make_mesh(decode_mesh_shape(config, len(devices)), devices)
  found, known = {}, {}
  for kind, width, batch in SHAPES:
    shape = StepShape(kind, batch=batch, prompt=768, new_tokens=256, block_size=32, width=width)
    text = forward_probe(config, shape, mesh=mesh).lower().compile().as_text()
    for copy in copied_slices(text):
      where = known if _known(t.platform, model, kind, batch, copy) else found
      where.setdefault(f"{kind} w{width} b{batch}", []).append(copy)
  assert not found, found
  if t.platform == "cuda" and model == "dream-7b":  # the exception is still needed (else it should go)
    assert known and all(len(c) <= 2 * config.num_layers for c in known.values()), known
  else:
    assert not known, known


@pytest.mark.tpu
@pytest.mark.parametrize("target", ["v5e-8", "v5p-8"])
@pytest.mark.parametrize("model", ["llada-8b", "dream-7b"])
def test_scanned_decode_steps_copy_at_most_q_and_k_slices_on_tpu(target, model):
  from d2f_jax import sharding
  from d2f_jax.aot.programs import decode_mesh_shape
  t = topo.parse_target(target)
  topo.configure_jax(t.platform)
  devices = topo.devices(t)
  config = preset(model, dtype="bfloat16", param_dtype="bfloat16", attention_impl="pallas").replace(
      num_layers=3, layer_loop="scan")
  mesh_shape = decode_mesh_shape(config, len(devices))
  mesh = sharding.make_mesh(mesh_shape, devices)
  q_slice = config.embed_dim * config.num_heads * config.head_dim * 2 // mesh_shape["tensor"]  # bf16 bytes a device
  k_slice = config.embed_dim * config.num_kv_heads * config.head_dim * 2 // mesh_shape["tensor"]
  for kind, width, batch in (("d2f_step", 2, 1), ("d2f_step", 2, 32), ("ar_step", 1, 1)):
    shape = StepShape(kind, batch=batch, prompt=768, new_tokens=256, block_size=32, width=width)
    text = forward_probe(config, shape, mesh=mesh).lower().compile().as_text()
    assert "while" in text  # the layers really are a loop
    copies = copied_slices(text)
    assert len(copies) <= 2 and all(c.bytes in (q_slice, k_slice) for c in copies), (kind, batch, copies)
