"""The model's logits do not change when the Pallas kernels replace the jnp reference attention.

`ModelConfig.attention_impl` selects the implementation; "interpret_gpu" / "interpret_tpu" run the real
kernels in the CPU interpreters, through the same `_layer` code path that "pallas" takes on a device.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from d2f_jax.models import PAD_ID, TINY_DREAM, KVCache, ModelConfig, logits_for_mode
from d2f_jax.models import forward as _forward
from d2f_jax.models.config import PRESETS
from jaxpr_utils import all_eqns
from model_utils import random_model, random_tokens

KERNEL_IMPLS = ["interpret_gpu", "interpret_tpu"]


def _split(impl, layer_loop="auto"):
  return nnx.split(random_model(TINY_DREAM.replace(attention_impl=impl, layer_loop=layer_loop)))


def _block_causal_logits(impl, tokens, mask):
  graphdef, state = _split(impl)
  return np.asarray(logits_for_mode(graphdef, state, tokens, mask, mode="block_causal",
                                    prompt_len=jnp.asarray([6, 4]), block_size=4))


def _decode_two_windows(impl, tokens, layer_loop="auto"):
  """Prompt into an empty cache (rows keep 6 and 4 of its tokens: ragged lengths), then a two-block window
  against it. Returns both windows' logits and the second window's ids."""
  graphdef, state = _split(impl, layer_loop)
  # Waited for: the TPU interpreter's callbacks run jnp ops of their own, and dispatching more work while
  # they are in flight can deadlock a 2-core CPU backend (seen with the two layers' kernel calls unrolled).
  forward = lambda *args: jax.block_until_ready(_forward(*args))
  batch = tokens.shape[0]
  cache = KVCache.init(TINY_DREAM, batch=batch, max_len=24)
  prompt = jnp.broadcast_to(jnp.arange(6), (batch, 6))
  first, (k, v) = forward(graphdef, state, tokens[:, :6], prompt, jnp.full((batch, 6), -1, jnp.int32), cache)
  cache = cache.write(k, v, jnp.full((batch, 6), -1, jnp.int32), jnp.asarray([6, 4], jnp.int32))
  positions = jnp.broadcast_to(jnp.arange(6, 14), (batch, 8))
  ids = jnp.broadcast_to(jnp.arange(8) // 4, (batch, 8)).astype(jnp.int32).at[1, -1].set(PAD_ID)
  second, _ = forward(graphdef, state, tokens[:, 6:14], positions, ids, cache)
  return np.asarray(first), np.asarray(second), np.asarray(ids)


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
def test_full_sequence_logits_unchanged(impl):
  tokens = random_tokens(TINY_DREAM, 2, 19, seed=3)
  mask = jnp.ones_like(tokens).at[1, :3].set(0)  # row 1 left-padded
  expected = _block_causal_logits("xla", tokens, mask)
  actual = _block_causal_logits(impl, tokens, mask)
  np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-5)
  # The tolerance is meaningful: bidirectional attention moves the logits far beyond it.
  graphdef, state = _split("xla")
  other = np.asarray(logits_for_mode(graphdef, state, tokens, mask, mode="bidirectional"))
  assert np.abs(other - expected).max() > 1e-2


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
def test_cached_decoding_logits_unchanged(impl):
  tokens = random_tokens(TINY_DREAM, 2, 14, seed=4)
  first_ref, second_ref, ids = _decode_two_windows("xla", tokens)
  first, second, _ = _decode_two_windows(impl, tokens)
  np.testing.assert_allclose(first, first_ref, rtol=0, atol=1e-5)
  real = ids != PAD_ID  # a padding query's output is unspecified with the kernels (see window_attention)
  np.testing.assert_allclose(second[real], second_ref[real], rtol=0, atol=1e-5)


@pytest.mark.parametrize("impl", ["xla", *KERNEL_IMPLS])
def test_unrolled_decode_layers_equal_the_scan(impl):
  """A cached forward runs its layers unrolled by default (the kernel reads the stacked cache at a static
  layer); it computes exactly what the scan over the layers computes."""
  tokens = random_tokens(TINY_DREAM, 2, 14, seed=4)
  first_scan, second_scan, ids = _decode_two_windows(impl, tokens, layer_loop="scan")
  first, second, _ = _decode_two_windows(impl, tokens)
  real = ids != PAD_ID
  np.testing.assert_allclose(first, first_scan, rtol=0, atol=1e-6)
  np.testing.assert_allclose(second[real], second_scan[real], rtol=0, atol=1e-6)
  if impl != "xla":
    return  # the interpreters run the kernels' own loops as scans: the check below is for the layers
  graphdef, state = _split(impl)
  cache = KVCache.init(TINY_DREAM, batch=2, max_len=24)
  positions = jnp.broadcast_to(jnp.arange(6), (2, 6))
  run = lambda c: _forward(graphdef, state, tokens[:, :6], positions, jnp.zeros((2, 6), jnp.int32), c)
  assert "scan" not in str(jax.make_jaxpr(run)(cache))  # the default really unrolls a cached forward ...
  assert "scan" in str(jax.make_jaxpr(lambda: run(None))())  # ... and scans one without a cache


def test_a_cache_in_another_dtype_is_converted_one_layer_at_a_time():
  """A bf16 cache under an fp32 model: the unrolled forward converts each layer's slice, never the stack (a
  copy of every layer per layer), and computes what the scan over per-layer slices computes."""
  tokens = random_tokens(TINY_DREAM, 2, 6, seed=6)
  positions = jnp.broadcast_to(jnp.arange(6), (2, 6))
  ids = jnp.zeros((2, 6), jnp.int32)
  cache = KVCache.init(TINY_DREAM, batch=2, max_len=24, dtype=jnp.bfloat16)
  cache = cache.replace(k=cache.k + 0.5, v=cache.v - 0.25, ids=cache.ids.at[:, :4].set(0),
                        length=jnp.full((2,), 4, jnp.int32))
  logits = {}
  for loop in ("scan", "auto"):
    graphdef, state = _split("interpret_gpu", loop)  # the kernel path: XLA attention always slices
    logits[loop], _ = _forward(graphdef, state, tokens, positions, ids, cache)
  np.testing.assert_allclose(np.asarray(logits["auto"]), np.asarray(logits["scan"]), rtol=0, atol=1e-6)
  graphdef, state = _split("interpret_gpu")
  jaxpr = jax.make_jaxpr(lambda c: _forward(graphdef, state, tokens, positions, ids, c))(cache)
  converted = [tuple(eqn.outvars[0].aval.shape) for eqn in all_eqns(jaxpr.jaxpr)
               if eqn.primitive.name == "convert_element_type"]
  assert tuple(cache.k.shape[1:]) in converted and tuple(cache.k.shape) not in converted, converted


def test_auto_is_the_reference_on_cpu_and_impl_is_validated():
  tokens = random_tokens(TINY_DREAM, 2, 9, seed=5)
  mask = jnp.ones_like(tokens)
  np.testing.assert_array_equal(_block_causal_logits("auto", tokens, mask), _block_causal_logits("xla", tokens, mask))
  with pytest.raises(ValueError, match="attention_impl must be one of"):
    TINY_DREAM.replace(attention_impl="triton")
  # "auto" is the default everywhere: kernels on an accelerator, exactly the reference here.
  assert ModelConfig.__dataclass_fields__["attention_impl"].default == "auto"
  assert {c.attention_impl for c in PRESETS.values()} == {"auto"}
