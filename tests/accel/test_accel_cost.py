"""`bench cost` with the real compilers at a small shape (the 8B tables come from the bench, not from CI): the
step programs compile for v5e-8 (Mosaic) and H100 (Triton), the compiler reports the Pallas window kernel as
opaque (custom call, ~0 FLOPs), the kernel (and the in-place cache write) is compiled alone and replaced by
its formula, the embedding gather is compiled alone and charged as its rows, and the accounted FLOPs of a D2F
step agree with the formula's within 1.5x (a width-256 model: its matmuls dominate)."""

import pytest

from d2f_jax.aot import topology as topo
from d2f_jax.bench.cost import compiled as cost_compile, model as cm
from d2f_jax.decode.forward_probes import StepShape
from d2f_jax.models import ModelConfig

SMALL = ModelConfig(vocab_size=2048, embed_dim=256, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=64,
                    mlp_dim=1024, dtype="bfloat16", param_dtype="bfloat16", attention_impl="pallas",
                    mask_token_id=2000, eos_token_id=2001, pad_token_id=2001)
OPAQUE = {"tpu": "tpu_custom_call", "cuda": "__gpu$xla.gpu.triton"}


@pytest.mark.parametrize("target", [pytest.param("v5e-8", marks=pytest.mark.tpu),
                                    pytest.param("h100", marks=pytest.mark.cuda)])
def test_step_costs_from_the_real_compiler(target):
  from d2f_jax.aot.programs import decode_mesh_shape
  from d2f_jax import sharding
  t = topo.parse_target(target)
  topo.configure_jax(t.platform)
  devices = topo.devices(t)
  mesh_shape = decode_mesh_shape(SMALL, len(devices))
  mesh = sharding.make_mesh(mesh_shape, devices)
  for kind, width in (("d2f_step", 2), ("ar_step", 1)):
    shape = StepShape(kind, batch=2, prompt=96, new_tokens=32, block_size=8, width=width)
    got = cost_compile.compiled_forward(SMALL, shape, mesh, log=lambda _: None)
    attention = cm.attention_cost(SMALL, shape, mesh_shape)
    assert got["opaque"] == [OPAQUE[t.platform]], got
    # Opaque: what the compiler counts for the kernel calls alone (their reshapes and pads) is a sliver of the
    # program's FLOPs, though the kernels compute all of attention.
    assert got["kernel"]["opaque"] == [OPAQUE[t.platform]], got
    assert SMALL.num_layers * got["kernel"]["flops"] < 0.05 * got["flops"], got
    assert got["flops"] > 0 and got["bytes"] > 0
    accounted = cm.accounted_cost(got, SMALL, shape, mesh_shape)
    assert accounted["source"] == ("compiled + attention formula + cache-write formula"
                                   " + embedding-gather formula"), accounted
    # The gather compiled alone is charged as the table (or more), the formula as its b x n rows.
    assert got["gather"]["bytes"] > cm.gather_cost(SMALL, shape, mesh_shape)["bytes"], got["gather"]
    assert accounted["flops"] >= attention["flops"]
    formula = cm.formula_cost(SMALL, shape, mesh_shape)
    if kind == "d2f_step":  # 16 tokens x 2 rows: the matmuls dominate, as the formula assumes
      assert 0.9 <= accounted["flops"] / formula["flops"] <= 1.5, (accounted, formula, mesh_shape)
    assert cm.milliseconds(accounted, cm_sheet(t)) > 0


def cm_sheet(t):
  from d2f_jax import datasheets
  from d2f_jax.bench.cost import SHEETS
  return datasheets.by_name(SHEETS[t.kind])
