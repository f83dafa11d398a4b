"""The kernels lower to real Triton and Mosaic modules at model shapes, without a GPU or TPU.

`jax.export` with platforms=["cuda"] / ["tpu"] runs the Pallas -> Triton IR and Pallas -> Mosaic lowerings
on CPU, which enforces the backends' block-shape rules (TPU (8, 128) tiling, Triton power-of-two tiles)
and that every primitive in the kernels has a lowering. It does not compile the modules further (PTX /
the Mosaic compiler): that, and speed, only a device can check.
"""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax import export

from d2f_jax.kernels import common, flash_attention, window_attention

TARGETS = {"cuda": ("gpu", "__gpu$xla.gpu.triton"), "tpu": ("tpu", "tpu_custom_call")}
_UNCHECKED = [export.DisabledSafetyCheck.custom_call(target) for _, target in TARGETS.values()]


def _lower(platform, fn, *args):
  return export.export(jax.jit(fn), platforms=[platform], disabled_checks=_UNCHECKED)(*args).mlir_module()


def _kernel_calls(module_text, target):
  return module_text.count(f"stablehlo.custom_call @{target}")


@pytest.fixture(params=sorted(TARGETS))
def platform(request, monkeypatch):
  """Dispatch as if on that device. The wrappers' undecorated bodies are traced afresh, so no trace
  cached for the CPU platform is reused."""
  backend, _ = TARGETS[request.param]
  monkeypatch.setattr(common, "_platform", lambda: backend)
  return request.param


@pytest.mark.parametrize("dtype,heads,head_dim", [("bfloat16", (28, 4), 128), ("float32", (4, 4), 64)])
def test_flash_forward_and_backward_lower(platform, dtype, heads, head_dim):
  num_heads, num_kv_heads = heads
  batch, length = 2, 300  # not a multiple of any tile
  sd = jax.ShapeDtypeStruct
  q = sd((batch, length, num_heads, head_dim), jnp.dtype(dtype))
  kv = sd((batch, length, num_kv_heads, head_dim), jnp.dtype(dtype))
  ids = sd((batch, length), jnp.int32)
  attention = functools.partial(flash_attention.__wrapped__, impl="pallas")
  loss = lambda q, k, v, ids: jnp.sum(attention(q, k, v, ids, ids).astype(jnp.float32))
  text = _lower(platform, jax.grad(loss, (0, 1, 2)), q, kv, kv, ids)
  assert _kernel_calls(text, TARGETS[platform][1]) == 3  # forward, dK/dV, dQ


@pytest.mark.parametrize("heads,window,cache,layers", [((28, 4), 48, 1024, None), ((32, 32), 32, 520, None),
                                                      ((32, 32), 32, 1024, 3)])
def test_window_attention_lowers(platform, heads, window, cache, layers):
  """layers: the model's stacked [L, B, S, K, D] cache, read at layer 2 in place."""
  num_heads, num_kv_heads = heads
  batch, head_dim, dtype = 2, 128, jnp.bfloat16
  sd = jax.ShapeDtypeStruct
  stack = () if layers is None else (layers,)
  args = (sd((batch, window, num_heads, head_dim), dtype), sd((batch, window, num_kv_heads, head_dim), dtype),
          sd((batch, window, num_kv_heads, head_dim), dtype), sd((batch, window), jnp.int32),
          sd((batch, window), jnp.int32), sd((*stack, batch, cache, num_kv_heads, head_dim), dtype),
          sd((*stack, batch, cache, num_kv_heads, head_dim), dtype), sd((batch, cache), jnp.int32),
          sd((batch,), jnp.int32))
  layer = None if layers is None else layers - 1
  text = _lower(platform, functools.partial(window_attention.__wrapped__, impl="pallas", layer=layer), *args)
  assert _kernel_calls(text, TARGETS[platform][1]) == 1
  if layers is not None:  # the stack itself is the kernel's operand: no slice of it is materialized first
    assert "stablehlo.slice" not in text and "dynamic_slice" not in text, text
