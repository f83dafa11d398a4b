"""The Pallas attention kernels against their jnp references, in the GPU (Triton) and TPU (Mosaic)
interpreters on CPU.

Each backend is one test class; `TestKernelsTPUInterpret` re-runs every test of `TestKernelsGPUInterpret`
with the TPU interpreter and TPU-legal tiles. Tiles are tiny so that ragged lengths, partial tiles and
skipped tiles all occur at test sizes.
"""

import zlib

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from d2f_jax.kernels import BlockSizes, flash_attention, window_attention, window_attention_reference
from d2f_jax.models import PAD_ID, attention_ids, attention_reference
from jaxpr_utils import all_eqns

TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}
# (name, query heads, kv heads, head_dim): Dream-like GQA 7:1 at head_dim 64, LLaDA-like MHA at 128.
HEADS = {"gqa7": (7, 1, 64), "mha": (2, 2, 128)}


def _rng(*key):
  """A fresh generator per test case, reproducible across runs (unlike hash() of strings)."""
  return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _normal(rng, shape, dtype):
  return jnp.asarray(rng.normal(size=shape), jnp.float32).astype(dtype)


def _assert_close(actual, expected, dtype, valid=None):
  """Max-abs comparison at the dtype's tolerance, on the rows where `valid` [B, T] is True."""
  actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
  if valid is not None:
    actual, expected = actual[np.asarray(valid)], expected[np.asarray(valid)]
  assert np.isfinite(actual).all()
  np.testing.assert_allclose(actual, expected, rtol=0, atol=TOLERANCE[dtype])


def _window_inputs(rng, heads, dtype, cache_size, lengths, window=11, block=4):
  """A decode step: cache rows written up to `lengths` (row 0 starts with two left-padding slots), random
  ids up to two blocks ahead of the window so some cache slots are invisible, NaN in every unwritten slot,
  and a block-causal window that ends mid-block, whose last two tokens are padding in row 0."""
  num_heads, num_kv_heads, head_dim = heads
  batch = len(lengths)
  lengths = jnp.asarray(lengths, jnp.int32)
  base = 3  # the window's first block id
  written = np.arange(cache_size)[None, :] < np.asarray(lengths)[:, None]  # [B, S]
  cache_ids = rng.integers(-1, base + 2, size=(batch, cache_size))
  cache_ids[0, :2] = PAD_ID
  cache_ids = jnp.asarray(np.where(written, cache_ids, PAD_ID), jnp.int32)
  win_ids = np.broadcast_to(base + np.arange(window) // block, (batch, window)).copy()
  win_ids[0, -2:] = PAD_ID
  win_ids = jnp.asarray(win_ids, jnp.int32)
  q = _normal(rng, (batch, window, num_heads, head_dim), dtype)
  k_win, v_win = (_normal(rng, (batch, window, num_kv_heads, head_dim), dtype) for _ in range(2))
  cache_k, cache_v = (_normal(rng, (batch, cache_size, num_kv_heads, head_dim), dtype) for _ in range(2))
  garbage = lambda x: jnp.where(jnp.asarray(written)[:, :, None, None], x, jnp.nan)
  return dict(q=q, k_win=k_win, v_win=v_win, q_ids=win_ids, win_ids=win_ids, cache_k=garbage(cache_k),
              cache_v=garbage(cache_v), cache_ids=cache_ids, cache_len=lengths), jnp.asarray(written)


def _sequence_ids(pattern, batch, length):
  positions = jnp.broadcast_to(jnp.arange(length), (batch, length))
  valid = positions >= jnp.asarray([[0], [3]])  # row 1 is left-padded by three tokens
  if pattern == "block_causal":
    return attention_ids(positions - jnp.asarray([[0], [3]]), pattern, valid=valid,
                         prompt_len=jnp.asarray([7, 20]), block_size=8)
  return attention_ids(positions, pattern, valid=valid)


class TestKernelsGPUInterpret:
  INTERPRET = "gpu"
  WINDOW_BLOCKS = BlockSizes(block_q=16, block_k=16)
  FLASH_BLOCKS = BlockSizes(block_q=16, block_k=16, block_q_dkv=16, block_k_dkv=32, block_q_dq=32, block_k_dq=16)
  CACHE_SIZE = 40  # not a multiple of block_k: the wrapper pads the cache
  STACKED_CACHE_SIZE = 48
  SEQ_LEN = 45

  def _window(self, **inputs):
    return window_attention(**inputs, impl="pallas", interpret=self.INTERPRET, block_sizes=self.WINDOW_BLOCKS)

  def _flash(self, q, k, v, ids):
    return flash_attention(q, k, v, ids, ids, impl="pallas", interpret=self.INTERPRET,
                           block_sizes=self.FLASH_BLOCKS)

  @pytest.mark.parametrize("heads,dtype", [("gqa7", "float32"), ("mha", "float32"), ("gqa7", "bfloat16"),
                                           ("mha", "bfloat16")])
  def test_window_matches_reference(self, heads, dtype):
    rng = _rng(self.INTERPRET, heads, dtype)
    inputs, written = _window_inputs(rng, HEADS[heads], dtype, self.CACHE_SIZE, lengths=(self.CACHE_SIZE, 0, 1))
    clean = dict(inputs, cache_k=jnp.where(written[:, :, None, None], inputs["cache_k"], 0),
                 cache_v=jnp.where(written[:, :, None, None], inputs["cache_v"], 0))
    expected = window_attention_reference(**clean)
    actual = self._window(**inputs)
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    _assert_close(actual, expected, dtype, valid=inputs["q_ids"] != PAD_ID)

  def test_window_longer_than_a_key_tile(self):
    """A window wider than block_k (an AR prefill's whole prompt) is read in several key tiles."""
    rng = _rng(self.INTERPRET, "window_tiles", "float32")
    inputs, written = _window_inputs(rng, HEADS["gqa7"], "float32", self.CACHE_SIZE, lengths=(5, 0, 17),
                                     window=37, block=8)
    clean = dict(inputs, cache_k=jnp.where(written[:, :, None, None], inputs["cache_k"], 0),
                 cache_v=jnp.where(written[:, :, None, None], inputs["cache_v"], 0))
    _assert_close(self._window(**inputs), window_attention_reference(**clean), "float32",
                  valid=inputs["q_ids"] != PAD_ID)

  def test_window_detects_a_wrong_mask(self):
    """The comparison above can fail: the kernel is far from a reference whose window is bidirectional."""
    rng = _rng(self.INTERPRET, "wrong")
    inputs, written = _window_inputs(rng, HEADS["gqa7"], "float32", self.CACHE_SIZE, lengths=(9, 20, 30))
    clean = dict(inputs, cache_k=jnp.where(written[:, :, None, None], inputs["cache_k"], 0),
                 cache_v=jnp.where(written[:, :, None, None], inputs["cache_v"], 0))
    wrong = dict(clean, win_ids=jnp.where(clean["win_ids"] == PAD_ID, PAD_ID, 0))
    actual = np.asarray(self._window(**inputs))
    valid = np.asarray(inputs["q_ids"] != PAD_ID)
    assert np.abs(actual - np.asarray(window_attention_reference(**wrong)))[valid].max() > 1e-2
    # ... and so is it from one that ignores cache_len (reading the zeroed unwritten slots).
    ignore_len = dict(clean, cache_ids=jnp.where(written, clean["cache_ids"], -1),
                      cache_len=jnp.full_like(clean["cache_len"], self.CACHE_SIZE))
    assert np.abs(actual - np.asarray(window_attention_reference(**ignore_len)))[valid].max() > 1e-2

  def test_window_reads_one_layer_of_a_stacked_cache_in_place(self):
    """layer=i on the stacked [L, B, S, K, D] cache equals the call on its slice i, and the kernel takes the
    stack whole (a slice would be a copy per call); the other layers hold NaN, so reading one would show."""
    rng = _rng(self.INTERPRET, "stacked")
    size = self.STACKED_CACHE_SIZE  # a multiple of block_k: no padding, so nothing forces a slice
    inputs, _ = _window_inputs(rng, HEADS["mha"], "float32", size, lengths=(size, 0, 9))
    poison = jnp.full_like(inputs["cache_k"], jnp.nan)
    stacked = dict(inputs, cache_k=jnp.stack([poison, inputs["cache_k"], poison]),
                   cache_v=jnp.stack([poison, inputs["cache_v"], poison]))
    actual = self._window(**stacked, layer=1)
    np.testing.assert_array_equal(np.asarray(actual), np.asarray(self._window(**inputs)))
    jaxpr = jax.make_jaxpr(lambda a: self._window(**a, layer=1))(stacked)
    operands = [tuple(v.aval.shape) for eqn in all_eqns(jaxpr.jaxpr) if eqn.primitive.name == "pallas_call"
                for v in eqn.invars]
    assert any(shape[:3] == (3, 3, size) for shape in operands), operands

  def test_window_reads_a_traced_layer_of_a_stacked_cache(self):
    """layer_index, a layer loop's traced counter, reads the same layer as the static layer; the TPU kernel
    takes the stack whole (scalar-prefetched index), the GPU one gets that layer sliced out."""
    rng = _rng(self.INTERPRET, "stacked_traced")
    size = self.STACKED_CACHE_SIZE  # and head_dim 128: the TPU kernel reads the stack without padding D
    inputs, _ = _window_inputs(rng, HEADS["mha"], "float32", size, lengths=(size, 0, 9))
    poison = jnp.full_like(inputs["cache_k"], jnp.nan)
    stacked = dict(inputs, cache_k=jnp.stack([poison, poison, inputs["cache_k"]]),
                   cache_v=jnp.stack([poison, poison, inputs["cache_v"]]))
    traced = jax.jit(lambda a, i: self._window(**a, layer_index=i))
    actual = traced(stacked, jnp.int32(2))
    np.testing.assert_array_equal(np.asarray(actual), np.asarray(self._window(**inputs)))
    jaxpr = jax.make_jaxpr(lambda a, i: self._window(**a, layer_index=i))(stacked, jnp.int32(2))
    operands = [tuple(v.aval.shape) for eqn in all_eqns(jaxpr.jaxpr) if eqn.primitive.name == "pallas_call"
                for v in eqn.invars]
    assert any(shape[:3] == (3, 3, size) for shape in operands) == (self.INTERPRET == "tpu"), operands

  @pytest.mark.parametrize("pattern,heads,dtype", [("block_causal", "gqa7", "float32"),
                                                   ("bidirectional", "mha", "bfloat16"),
                                                   ("causal", "mha", "float32")])
  def test_flash_forward_matches_reference(self, pattern, heads, dtype):
    num_heads, num_kv_heads, head_dim = HEADS[heads]
    rng = _rng(self.INTERPRET, pattern, dtype)
    batch, length = 2, self.SEQ_LEN
    q = _normal(rng, (batch, length, num_heads, head_dim), dtype)
    k, v = (_normal(rng, (batch, length, num_kv_heads, head_dim), dtype) for _ in range(2))
    ids = _sequence_ids(pattern, batch, length)
    expected = attention_reference(q, k, v, ids, ids)
    actual = self._flash(q, k, v, ids)
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    _assert_close(actual, expected, dtype)  # every row, padding rows included
    # A deliberately wrong pattern is far outside the tolerance.
    wrong = attention_reference(q, k, v, ids, jnp.where(ids == PAD_ID, PAD_ID, ids - 1))
    if pattern != "bidirectional":
      assert np.abs(np.asarray(actual, np.float32) - np.asarray(wrong, np.float32)).max() > 0.1

  @pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
  def test_flash_gradients_match_reference(self, dtype):
    num_heads, num_kv_heads, head_dim = HEADS["gqa7"] if dtype == "float32" else HEADS["mha"]
    rng = _rng(self.INTERPRET, "grad", dtype)
    batch, length = 2, self.SEQ_LEN
    q = _normal(rng, (batch, length, num_heads, head_dim), dtype)
    k, v = (_normal(rng, (batch, length, num_kv_heads, head_dim), dtype) for _ in range(2))
    cotangent = _normal(rng, q.shape, jnp.float32)
    ids = _sequence_ids("block_causal", batch, length)
    loss = lambda fn: lambda *qkv: jnp.sum(fn(*qkv).astype(jnp.float32) * cotangent)
    f32 = lambda x: x.astype(jnp.float32)
    expected = jax.grad(loss(lambda q, k, v: attention_reference(q, k, v, ids, ids)), (0, 1, 2))(
        f32(q), f32(k), f32(v))
    actual = jax.grad(loss(lambda q, k, v: self._flash(q, k, v, ids)), (0, 1, 2))(q, k, v)
    for name, a, e in zip(("dq", "dk", "dv"), actual, expected):
      assert a.dtype == jnp.dtype(dtype), name
      a, e = np.asarray(a, np.float32), np.asarray(e)
      # bf16 gradients against fp32 ones: relative to the gradient's scale (sums over up to 45 keys). fp32:
      # 1e-5 absolute plus 1e-5 relative, since dk / dv sum up to 45 products in an order the CPU's vector
      # width decides (one dk of -4.7149 was 1.3e-5 off on one machine, 2.7e-6 relative).
      tol = TOLERANCE[dtype] * (1.0 if dtype == "float32" else max(1.0, np.abs(e).max()))
      rtol = TOLERANCE[dtype] if dtype == "float32" else 0.0
      np.testing.assert_allclose(a, e, rtol=rtol, atol=tol, err_msg=name)
    wrong = jax.grad(loss(lambda q, k, v: attention_reference(q, k, v, ids, jnp.zeros_like(ids))), (1,))(
        f32(q), f32(k), f32(v))[0]
    assert np.abs(np.asarray(actual[1], np.float32) - np.asarray(wrong)).max() > 0.1


class TestKernelsTPUInterpret(TestKernelsGPUInterpret):
  INTERPRET = "tpu"
  WINDOW_BLOCKS = BlockSizes(block_q=8, block_k=128)
  FLASH_BLOCKS = BlockSizes(block_q=16, block_k=128, block_q_dkv=128, block_k_dkv=128, block_q_dq=32,
                            block_k_dq=128)
  CACHE_SIZE = 256  # two cache tiles: one skipped for the short rows, both read for the full one
  STACKED_CACHE_SIZE = 256
  SEQ_LEN = 200  # two key tiles, the second partly padding


# --- argument checking (no kernel runs) ------------------------------------------------------------

def _flash_args(batch=1, length=8, heads=4, kv_heads=2, head_dim=16, dtype=jnp.float32):
  q = jnp.zeros((batch, length, heads, head_dim), dtype)
  k = jnp.zeros((batch, length, kv_heads, head_dim), dtype)
  ids = jnp.zeros((batch, length), jnp.int32)
  return q, k, k, ids, ids


@pytest.mark.parametrize("change,message", [
    (lambda a: (a[0][0], *a[1:]), r"q must have shape \[B, T, H, D\]"),
    (lambda a: (a[0], a[1][..., :8], *a[2:]), r"k must have shape \[1, 8, 2, 16\]"),
    (lambda a: (a[0][:, :, :3], *a[1:]), r"query heads \(3\) must be a multiple of kv heads \(2\)"),
    (lambda a: (*a[:3], a[3][:, :5], a[4]), r"q_ids must have shape \[1, 8\], got \[1, 5\]"),
    (lambda a: (*a[:4], a[4].astype(jnp.float32)), r"k_ids must have dtype int32, got float32"),
    (lambda a: (a[0], a[1].astype(jnp.bfloat16), *a[2:]), r"k must have q's dtype float32, got bfloat16"),
    (lambda a: (a[0].astype(jnp.int32), *a[1:]), r"q must be floating point"),
])
def test_flash_rejects_bad_arguments(change, message):
  with pytest.raises(ValueError, match=message):
    flash_attention(*change(_flash_args()), impl="pallas", interpret="gpu")


def test_window_rejects_bad_arguments():
  q, k, v, ids, _ = _flash_args()
  cache = jnp.zeros((1, 32, 2, 16))
  cache_ids = jnp.zeros((1, 32), jnp.int32)
  good = dict(q=q, k_win=k, v_win=v, q_ids=ids, win_ids=ids, cache_k=cache, cache_v=cache, cache_ids=cache_ids,
              cache_len=jnp.zeros((1,), jnp.int32))
  for change, message in [
      (dict(cache_v=cache[:, :16]), r"cache_v must have shape \[1, 32, 2, 16\], got \[1, 16, 2, 16\]"),
      (dict(cache_len=jnp.zeros((2,), jnp.int32)), r"cache_len must have shape \[1\]"),
      (dict(cache_ids=cache_ids.astype(jnp.int16)), r"cache_ids must have dtype int32"),
      (dict(cache_k=cache.astype(jnp.bfloat16)), r"cache_k must have q's dtype float32"),
      (dict(win_ids=ids[:, :3]), r"win_ids must have shape \[1, 8\]")]:
    with pytest.raises(ValueError, match=message):
      window_attention(**{**good, **change}, impl="pallas", interpret="tpu")
  stacked = dict(good, cache_k=jnp.stack([cache, cache]), cache_v=jnp.stack([cache, cache]))
  with pytest.raises(ValueError, match=r"layer must be an int indexing cache_k's leading \[L\] axis, got 2"):
    window_attention(**stacked, layer=2, impl="pallas", interpret="tpu")
  with pytest.raises(ValueError, match=r"stacked \[L, B, S, K, D\] cache: pass layer="):
    window_attention(**stacked, impl="pallas", interpret="tpu")
  with pytest.raises(ValueError, match=r"pass layer \(a static int\) or layer_index"):
    window_attention(**stacked, layer=0, layer_index=jnp.int32(0), impl="pallas", interpret="tpu")
  with pytest.raises(ValueError, match=r"layer_index must have dtype int32"):
    window_attention(**stacked, layer_index=jnp.float32(0), impl="pallas", interpret="tpu")


def test_block_sizes_and_dispatch_are_validated():
  with pytest.raises(ValueError, match="block_q must be a positive int"):
    BlockSizes(block_q=0)
  with pytest.raises(ValueError, match=r"block_k=24: the GPU \(Triton\) kernels need a power of two >= 16"):
    flash_attention(*_flash_args(), impl="pallas", interpret="gpu", block_sizes=BlockSizes(16, 24))
  with pytest.raises(ValueError, match=r"block_k=64: the TPU \(Mosaic\) kernels need a multiple of 128"):
    flash_attention(*_flash_args(), impl="pallas", interpret="tpu", block_sizes=BlockSizes(8, 64))
  with pytest.raises(ValueError, match=r"block_q_dkv \(unset, so 8 from block_q\).*multiple of 128"):
    BlockSizes(block_q=8, block_k=128).validate("tpu")
  assert BlockSizes(block_q=8, block_k=128).validate("tpu", backward=False).block_q_dkv == 8
  for backend in ("gpu", "tpu"):
    for kernel in ("flash", "window"):
      BlockSizes.get_default(backend, kernel).validate(backend)
  with pytest.raises(ValueError, match="GPU .* head_dim a power of two"):
    flash_attention(*_flash_args(head_dim=24), impl="pallas", interpret="gpu")
  with pytest.raises(ValueError, match="impl must be one of"):
    flash_attention(*_flash_args(), impl="triton")
  with pytest.raises(ValueError, match="interpret must be one of"):
    flash_attention(*_flash_args(), impl="pallas", interpret=True)
  if jax.default_backend() == "cpu":
    with pytest.raises(ValueError, match="impl='pallas' needs a GPU or TPU backend"):
      flash_attention(*_flash_args(), impl="pallas")
    # "auto" on CPU is the reference itself.
    args = _flash_args()
    np.testing.assert_array_equal(flash_attention(*args, impl="auto"), attention_reference(*args))
