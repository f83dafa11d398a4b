"""The attention modes agree with each other the way the spec says they must."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from d2f_jax.models import (PAD_ID, TINY_DREAM, TINY_LLADA, KVCache, align_logits, attention_ids, attention_reference,
                            forward, logits_for_mode)
from model_utils import random_model, random_tokens

CONFIGS = {"llada": TINY_LLADA, "dream": TINY_DREAM}


def _run(model, tokens, mode, **kw):
  graphdef, state = nnx.split(model)
  mask = jnp.ones_like(tokens)
  return np.asarray(logits_for_mode(graphdef, state, tokens, mask, mode=mode, align=False, **kw))


def test_attention_ids_rules():
  pos = jnp.arange(10)[None]
  np.testing.assert_array_equal(attention_ids(pos, "block_causal", prompt_len=3, block_size=4)[0],
                                [-1, -1, -1, 0, 0, 0, 0, 1, 1, 1])
  np.testing.assert_array_equal(attention_ids(pos, "causal")[0], np.arange(10))
  valid = jnp.arange(10)[None] >= 2
  ids = attention_ids(pos, "bidirectional", valid=valid)[0]
  assert (ids[:2] == PAD_ID).all() and (ids[2:] == 0).all()
  with pytest.raises(ValueError, match="prompt_len and block_size"):
    attention_ids(pos, "block_causal")
  with pytest.raises(ValueError, match="unknown attention mode"):
    attention_ids(pos, "sliding")


def test_reference_matches_dense_softmax_gqa():
  rng = np.random.default_rng(0)
  q = rng.normal(size=(2, 5, 6, 8)).astype(np.float32)
  k = rng.normal(size=(2, 7, 2, 8)).astype(np.float32)
  v = rng.normal(size=(2, 7, 2, 8)).astype(np.float32)
  q_ids = rng.integers(0, 3, size=(2, 5)).astype(np.int32)
  k_ids = rng.integers(0, 3, size=(2, 7)).astype(np.int32)
  k_ids[:, 0] = 0  # every query sees at least one key
  out = np.asarray(attention_reference(q, k, v, q_ids, k_ids))
  for b in range(2):
    for h in range(6):
      kv = h // 3
      s = q[b, :, h] @ k[b, :, kv].T / np.sqrt(8)
      s = np.where(k_ids[b][None] <= q_ids[b][:, None], s, -np.inf)
      p = np.exp(s - s.max(-1, keepdims=True))
      p /= p.sum(-1, keepdims=True)
      np.testing.assert_allclose(out[b, :, h], p @ v[b, :, kv], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_block_causal_equals_bidirectional_block_by_block(family):
  """Block-causal over the whole sequence == running the prompt, then each block, bidirectionally on its
  own with only the truncated prefix before it (as K/V computed when that prefix was the whole input)."""
  config = CONFIGS[family]
  model = random_model(config)
  graphdef, state = nnx.split(model)
  prompt_len, block, total = 5, 4, 17  # the last block is partial
  tokens = random_tokens(config, 2, total)
  full = _run(model, tokens, "block_causal", prompt_len=prompt_len, block_size=block)
  np.testing.assert_allclose(full[:, :prompt_len], _run(model, tokens[:, :prompt_len], "bidirectional"),
                             rtol=1e-4, atol=1e-4)
  cache = KVCache.init(config, batch=2, max_len=total)
  bounds = [0, *range(prompt_len, total, block), total]
  for start, end in zip(bounds[:-1], bounds[1:]):
    positions = jnp.broadcast_to(jnp.arange(start, end), (2, end - start))
    inside = jnp.zeros_like(positions)  # bidirectional within the segment; everything cached is earlier
    logits, (k, v) = forward(graphdef, state, tokens[:, start:end], positions, inside, cache)
    np.testing.assert_allclose(np.asarray(logits), full[:, start:end], rtol=1e-4, atol=1e-4)
    cache = cache.write(k, v, inside - 1, jnp.full((2,), end - start, jnp.int32))
  # Prefix consistency at a block boundary: no block looks at a later one ...
  cut = prompt_len + 2 * block
  prefix = _run(model, tokens[:, :cut], "block_causal", prompt_len=prompt_len, block_size=block)
  np.testing.assert_allclose(prefix, full[:, :cut], rtol=1e-4, atol=1e-4)
  # ... and the pattern is genuinely different from bidirectional attention over everything.
  assert np.abs(full - _run(model, tokens, "bidirectional")).max() > 1e-2


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_causal_equals_token_by_token_with_cache(family):
  """Causal mode == AR decoding one token at a time against the KV cache (ids = positions)."""
  config = CONFIGS[family]
  model = random_model(config)
  graphdef, state = nnx.split(model)
  tokens = random_tokens(config, 2, 9, seed=3)
  full = _run(model, tokens, "causal")
  cache = KVCache.init(config, batch=2, max_len=9)
  for t in range(9):
    pos = jnp.full((2, 1), t, jnp.int32)
    logits, (k, v) = forward(graphdef, state, tokens[:, t:t + 1], pos, pos, cache)
    np.testing.assert_allclose(np.asarray(logits[:, 0]), full[:, t], rtol=1e-4, atol=1e-4)
    cache = cache.write(k, v, pos, jnp.ones((2,), jnp.int32))
  assert np.abs(full - _run(model, tokens, "bidirectional")).max() > 1e-2


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("mode", ["bidirectional", "block_causal", "causal"])
def test_left_padding_is_invisible(family, mode):
  config = CONFIGS[family]
  model = random_model(config)
  graphdef, state = nnx.split(model)
  tokens = random_tokens(config, 1, 12, seed=1)
  kw = dict(prompt_len=4, block_size=3) if mode == "block_causal" else {}
  alone = logits_for_mode(graphdef, state, tokens, jnp.ones_like(tokens), mode=mode, **kw)
  pad = 5
  padded = jnp.concatenate([jnp.full((1, pad), config.pad_token_id, jnp.int32), tokens], axis=1)
  mask = jnp.concatenate([jnp.zeros((1, pad), jnp.int32), jnp.ones_like(tokens)], axis=1)
  out = logits_for_mode(graphdef, state, padded, mask, mode=mode, **kw)
  np.testing.assert_allclose(np.asarray(out[:, pad:]), np.asarray(alone), rtol=1e-4, atol=1e-4)
  assert np.all(np.asarray(out[:, :pad]) == 0)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_incremental_window_equals_full_block_causal(family):
  """Prefill prompt + block 0 into the cache, then run blocks 1-2 as a window against it."""
  config = CONFIGS[family]
  model = random_model(config)
  graphdef, state = nnx.split(model)
  prompt_len, block = 6, 4
  total = prompt_len + 3 * block
  tokens = random_tokens(config, 2, total, seed=2)
  positions = jnp.broadcast_to(jnp.arange(total), tokens.shape)
  ids = attention_ids(positions, "block_causal", prompt_len=prompt_len, block_size=block)
  full, _ = forward(graphdef, state, tokens, positions, ids)

  split = prompt_len + block
  cache = KVCache.init(config, batch=2, max_len=32)
  _, (k, v) = forward(graphdef, state, tokens[:, :split], positions[:, :split], ids[:, :split], cache)
  cache = cache.write(k, v, ids[:, :split], jnp.full((2,), split, jnp.int32))
  window, _ = forward(graphdef, state, tokens[:, split:], positions[:, split:], ids[:, split:], cache)
  np.testing.assert_allclose(np.asarray(window), np.asarray(full[:, split:]), rtol=1e-4, atol=1e-4)
  # Dream's shift at the window edge takes the last cached position's output.
  aligned = align_logits(window, config, previous=full[:, split - 1])
  np.testing.assert_allclose(np.asarray(aligned), np.asarray(align_logits(full, config)[:, split:]),
                             rtol=1e-4, atol=1e-4)


def test_kv_cache_write_appends_per_row_and_drops_overflow():
  config = TINY_LLADA
  cache = KVCache.init(config, batch=2, max_len=6)
  shape = (config.num_layers, 2, 4, config.num_kv_heads, config.head_dim)
  k = jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape)
  ids = jnp.array([[0, 1, 2, 3], [4, 5, 6, 7]], jnp.int32)
  cache = cache.write(k, -k, ids, jnp.array([2, 4], jnp.int32))
  np.testing.assert_array_equal(cache.length, [2, 4])
  np.testing.assert_array_equal(cache.ids[0], [0, 1, PAD_ID, PAD_ID, PAD_ID, PAD_ID])
  np.testing.assert_array_equal(cache.ids[1], [4, 5, 6, 7, PAD_ID, PAD_ID])
  cache = cache.write(k, -k, ids, jnp.array([4, 4], jnp.int32))
  np.testing.assert_array_equal(cache.length, [6, 6])
  np.testing.assert_array_equal(cache.ids[0], [0, 1, 0, 1, 2, 3])
  np.testing.assert_array_equal(cache.ids[1], [4, 5, 6, 7, 4, 5])  # the overflow (6, 7) was dropped
  np.testing.assert_array_equal(cache.k[:, 1, 4:], k[:, 1, :2])
  np.testing.assert_array_equal(cache.v[:, 0, 2:], -k[:, 0])


def test_every_parameter_has_logical_axes():
  from d2f_jax.models import LoraConfig, Transformer
  model = Transformer(TINY_DREAM, LoraConfig(rank=4, targets=("q", "k", "v", "o", "gate", "up", "down")),
                      rngs=nnx.Rngs(0))
  allowed = {"layers", "embed", "heads", "kv_heads", "head_dim", "mlp", "vocab", "lora_rank"}
  count = 0
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    names = var.get_metadata()["out_sharding"]
    bases = {n.split(":")[0] for n in names}  # heads packed with head_dim: "heads:D"
    assert len(names) == var[...].ndim and bases <= allowed, (path, names)
    count += 1
  assert count == 1 + 1 + 1 + 12 + 14  # embedding, final norm, head, layer weights, 14 LoRA arrays


def test_remat_keeps_logits_and_gradients():
  """Rematerialised layers trade compute for memory only, and unrolled layers compile differently only:
  same loss and gradients as the plain scan."""
  tokens = random_tokens(TINY_DREAM, 2, 12, seed=5)
  positions = jnp.broadcast_to(jnp.arange(12), tokens.shape)
  ids = attention_ids(positions, "block_causal", prompt_len=4, block_size=4)

  def loss_and_grads(config):
    graphdef, state = nnx.split(random_model(config))

    def loss(state):
      logits, _ = nnx.merge(graphdef, state)(tokens, positions, ids)
      return jnp.mean(jax.nn.log_softmax(logits)[..., 7])

    return jax.value_and_grad(loss)(state)

  plain_loss, plain_grads = loss_and_grads(TINY_DREAM)
  for variant in (dict(remat=True), dict(layer_loop="unroll"), dict(layer_loop="unroll", remat=True)):
    loss, grads = loss_and_grads(TINY_DREAM.replace(**variant))
    np.testing.assert_allclose(loss, plain_loss, rtol=1e-6, err_msg=str(variant))
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(plain_grads)):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=str(variant))  # fp32 reassociation
