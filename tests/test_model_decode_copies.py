"""What a decode forward adds so the accelerator compilers move no byte they need not, and what it costs
the outputs: nothing. The barriers (q/k/v from three operands; the window's K/V tied to the last layer's
output, so the in-place cache write follows every cache read) are values-preserving; checked here bit for
bit under the product's compile settings, bf16 and fp32. The copies themselves are found in the optimized
H100 / TPU modules by d2f_jax.bench.hlo_copies (tests/accel/test_accel_copies.py); its parser is tested here
on module text."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from d2f_jax.api import Model
from d2f_jax.bench.hlo_copies import copied_slices
from d2f_jax.decode import DecodeConfig, generate
from d2f_jax.models import TINY_DREAM, TINY_LLADA, KVCache
from d2f_jax.models import forward as _forward
from jaxpr_utils import all_eqns
from model_utils import random_model

PROMPTS = [[5, 6, 7, 9, 11], [8, 9, 10, 11, 12, 13, 14], [13, 2]]


def _decode(config, method):
  model = Model.from_module(random_model(config, seed=1))
  decode = DecodeConfig(method=method, block_size=4, max_new_tokens=16, max_blocks_in_flight=2, tau_conf=0.05,
                        prompt_buckets=8)
  result = generate(model, PROMPTS, decode)
  return np.asarray(result.tokens), np.asarray(result.forwards)


@pytest.mark.parametrize("config, dtype, method", [(TINY_LLADA, "bfloat16", "d2f"), (TINY_DREAM, "bfloat16", "ar"),
                                                   (TINY_DREAM, "float32", "d2f")])
def test_the_decode_barriers_change_no_output_bit(config, dtype, method, product_compile_settings, monkeypatch):
  config = config.replace(dtype=dtype, param_dtype=dtype)
  jax.clear_caches()
  with_barriers = _decode(config, method)
  monkeypatch.setattr(jax.lax, "optimization_barrier", lambda values: values)
  jax.clear_caches()
  without = _decode(config, method)
  jax.clear_caches()
  for a, b in zip(with_barriers, without):
    np.testing.assert_array_equal(a, b)


def test_the_barriers_are_in_cached_forwards_only():
  module = random_model(TINY_DREAM)
  graphdef, state = nnx.split(module)
  tokens = jnp.zeros((2, 6), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(6), (2, 6))
  ids = jnp.zeros((2, 6), jnp.int32)

  def barriers(cache):
    jaxpr = jax.make_jaxpr(lambda: _forward(graphdef, state, tokens, positions, ids, cache))()
    return sum(eqn.primitive.name == "optimization_barrier" for eqn in all_eqns(jaxpr.jaxpr))
  # one per layer (q/k/v operands) and one tying the window's K/V to the last layer's output
  assert barriers(KVCache.init(TINY_DREAM, batch=2, max_len=12)) == TINY_DREAM.num_layers + 1
  assert barriers(None) == 0  # training and prefill-free forwards are untouched


_MODULE = """HloModule step

%wrapped_slice_computation (param_0: bf16[3,32,128,4096]) -> bf16[1,32,128,4096] {
  %param_0 = bf16[3,32,128,4096]{3,2,1,0} parameter(0)
  ROOT %slice.1 = bf16[1,32,128,4096]{3,2,1,0} slice(%param_0), slice={[0:1], [0:32], [0:128], [0:4096]}
}

%fused_dus (p0: bf16[3,1,1024,32,128], p1: bf16[1,1,1,32,128], p2: s32[]) -> bf16[3,1,1024,32,128] {
  %p0 = bf16[3,1,1024,32,128]{4,3,2,1,0} parameter(0)
  %p1 = bf16[1,1,1,32,128]{4,3,2,1,0} parameter(1)
  %p2 = s32[] parameter(2)
  ROOT %dus = bf16[3,1,1024,32,128]{4,3,2,1,0} dynamic-update-slice(%p0, %p1, %p2, %p2, %p2, %p2, %p2)
}

%gemm (a: bf16[1,4096], b: bf16[3,4096,4096]) -> f32[1,4096] {
  %a = bf16[1,4096]{1,0} parameter(0)
  %b = bf16[3,4096,4096]{2,1,0} parameter(1)
  ROOT %d = f32[1,4096]{1,0} dot(%a, %b)
}

ENTRY %main (params__layers____o___value.1: bf16[3,32,128,4096], state_cache_k.1: bf16[3,1,1024,32,128], x: bf16[1,4096]) -> f32[1,4096] {
  %params__layers____o___value.1 = bf16[3,32,128,4096]{3,2,1,0} parameter(0), sharding={replicated}
  %state_cache_k.1 = bf16[3,1,1024,32,128]{4,3,2,1,0} parameter(1)
  %params__layers____q___value.1 = bf16[3,4096,4096]{2,1,0} parameter(2)
  %x = bf16[1,4096]{1,0} parameter(3)
  %new = bf16[1,1,1,32,128]{4,3,2,1,0} parameter(4)
  %i = s32[] parameter(5)
  %wrapped_slice = bf16[1,32,128,4096]{3,2,1,0} fusion(%params__layers____o___value.1), kind=kLoop, calls=%wrapped_slice_computation
  %copy.7 = bf16[3,1,1024,32,128]{4,3,2,1,0} copy(%state_cache_k.1)
  %small = bf16[1,32]{1,0} slice(%params__layers____o___value.1), slice={[0:1], [0:32]}
  %write = bf16[3,1,1024,32,128]{4,3,2,1,0} fusion(%copy.7, %new, %i), kind=kLoop, calls=%fused_dus
  %gemm_fusion_dot = f32[1,4096]{1,0} fusion(%x, %params__layers____q___value.1), kind=kCustom, calls=%gemm
  ROOT %out = f32[1,4096]{1,0} add(%gemm_fusion_dot, %gemm_fusion_dot)
}
"""


def test_copied_slices_finds_copies_of_weight_and_cache_slices_only():
  found = {(c.instruction, c.op, c.source, c.bytes) for c in copied_slices(_MODULE)}
  assert found == {("wrapped_slice", "kLoop", "params__layers____o___value.1", 32 * 128 * 4096 * 2),
                   ("copy.7", "copy", "state_cache_k.1", 3 * 1024 * 32 * 128 * 2)}
  # the 64-byte slice is under the threshold; the gemm fusion and the in-place update read in place
  assert [c.instruction for c in copied_slices(_MODULE, min_bytes=1)] == ["wrapped_slice", "copy.7", "small"]


_LOOP_MODULE = """HloModule scan

%sliced (p0: bf16[3,4096,512], p1: s32[]) -> bf16[1,4096,512] {
  %p0 = bf16[3,4096,512]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  ROOT %ds = bf16[1,4096,512]{2,1,0} dynamic-slice(%p0, %p1, %zero, %zero), dynamic_slice_sizes={1,4096,512}
}

%matmul_in_place (p0: bf16[3,4096,1536], p1: s32[], x: bf16[64,4096]) -> bf16[64,1536] {
  %p0 = bf16[3,4096,1536]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %x = bf16[64,4096]{1,0} parameter(2)
  %zero = s32[] constant(0)
  %ds = bf16[1,4096,1536]{2,1,0} dynamic-slice(%p0, %p1, %zero, %zero), dynamic_slice_sizes={1,4096,1536}
  %w = bf16[4096,1536]{1,0} bitcast(%ds)
  ROOT %d = bf16[64,1536]{1,0} convolution(%x, %w), dim_labels=bf_io->bf
}

%body (arg: (s32[], bf16[3,4096,512], bf16[3,4096,1536], bf16[64,4096])) -> (s32[], bf16[3,4096,512], bf16[3,4096,1536], bf16[64,4096]) {
  %arg = (s32[], bf16[3,4096,512], bf16[3,4096,1536], bf16[64,4096]) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %wq = bf16[3,4096,512]{2,1,0} get-tuple-element(%arg), index=1
  %wu = bf16[3,4096,1536]{2,1,0} get-tuple-element(%arg), index=2
  %x = bf16[64,4096]{1,0} get-tuple-element(%arg), index=3
  %copied = bf16[1,4096,512]{2,1,0} fusion(%wq, %i), kind=kLoop, calls=%sliced
  %up = bf16[64,1536]{1,0} fusion(%wu, %i, %x), kind=kOutput, calls=%matmul_in_place
  ROOT %t = (s32[], bf16[3,4096,512], bf16[3,4096,1536], bf16[64,4096]) tuple(%i, %wq, %wu, %x)
}

ENTRY %main (w: bf16[3,4096,512], u: bf16[3,4096,1536], x: bf16[64,4096]) -> bf16[64,4096] {
  %w = bf16[3,4096,512]{2,1,0} parameter(0)
  %u = bf16[3,4096,1536]{2,1,0} parameter(1)
  %x = bf16[64,4096]{1,0} parameter(2)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[3,4096,512], bf16[3,4096,1536], bf16[64,4096]) tuple(%zero, %w, %u, %x)
  %loop = (s32[], bf16[3,4096,512], bf16[3,4096,1536], bf16[64,4096]) while(%init), condition=%cond, body=%body
  ROOT %out = bf16[64,4096]{1,0} get-tuple-element(%loop), index=3
}
"""


def test_copied_slices_finds_slices_a_layer_loop_materializes():
  """In a scan's body a slice fused into its matmul is read in place; one sliced out by itself is a copy."""
  assert [(c.instruction, c.op, c.source, c.bytes) for c in copied_slices(_LOOP_MODULE)] == [
      ("copied", "kLoop", "loop body slice", 4096 * 512 * 2)]
