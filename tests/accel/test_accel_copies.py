"""No copied weight or KV-cache slice in the optimized decode steps: LLaDA-8B and Dream-7B (cut to 3 layers;
every layer compiles alike), the AR step and D2F steps at widths 2 and 3, batch 1 and 32, cache 1024
(prompt 768 + 256, block 32), compiled by the real compilers for H100 (Triton / cuBLAS) and v5e-8 / v5p-8
(libtpu, whose byte counts are not trusted: the module's instructions are the instrument).

What is still moved, and so left out of the check by name until it is removed (tracked in the issue on the
decode steps' roofline), on H100 only:
- o's [H, D, E] layer slice feeds a split-K matmul that regroups (H, D) and cannot read it in place
  (storing o as [L, H*D, E] removes it: checked by hand on this compiler);
- Dream-7B's k and v at AR batch 1: a [1, E] x [E, 4, 128] product small enough for XLA to strength-reduce to
  multiply + reduce, whose product (the size of the layer's k / v slice) is materialized.
On every target everything else must be read in place: the guard fails on any other copy over 1 MiB."""

import pytest

from d2f_jax.aot import topology as topo
from d2f_jax.bench.hlo_copies import copied_slices
from d2f_jax.decode.step_programs import StepShape, step_program
from d2f_jax.models import preset



def _known(platform: str, model: str, kind: str, batch: int, copy) -> bool:
  """The open items above."""
  if platform != "cuda":
    return False
  if copy.source.startswith("params__layers____o___value"):
    return True
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
    text = step_program(config, shape, mesh=mesh).lower().compile().as_text()
    for copy in copied_slices(text):
      where = known if _known(t.platform, model, kind, batch, copy) else found
      where.setdefault(f"{kind} w{width} b{batch}", []).append(copy)
  assert not found, found
  if t.platform == "cuda":  # the exceptions are still needed (else they should go): a few per layer at most
    assert known and all(len(c) <= 3 * config.num_layers for c in known.values()), known
