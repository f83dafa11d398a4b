"""Noise schedule and masking: monotone, bounded, response-only, at the scheduled per-block rates."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from d2f_jax.train.masking import noise_batch, response_blocks
from d2f_jax.train.schedule import Schedule, block_ratios


def _ratios(kind, batch=512, num_blocks=8, seed=0, **bounds):
  blocks = jnp.full((batch,), num_blocks, jnp.int32)
  return np.asarray(block_ratios(jax.random.PRNGKey(seed), blocks, num_blocks, Schedule(kind, **bounds)))


def test_monotone_schedule_is_non_decreasing_and_within_reference_bounds():
  p = _ratios("monotone")
  assert (np.diff(p, axis=1) >= 0).all()
  assert p.min() >= 0.2 and p.max() <= 0.7 + 1e-6
  # p0 = U/2 + 0.2 spans the whole range; the last block reaches towards 0.7 on average.
  assert p[:, 0].min() < 0.25 and p[:, 0].max() > 0.65
  assert p[:, -1].mean() > p[:, 0].mean() + 0.1


def test_monotone_schedule_matches_the_reference_formula():
  key = jax.random.PRNGKey(3)
  n, batch = 5, 4
  p = np.asarray(block_ratios(key, jnp.full((batch,), n), n, Schedule()))
  k0, k1 = jax.random.split(key)
  u0 = np.asarray(jax.random.uniform(k0, (batch,)))
  u = np.asarray(jax.random.uniform(k1, (batch, n)))
  p0 = u0 / 2 + 0.2
  inc = u * (0.7 - p0)[:, None] / (n - 1)
  expected = np.minimum(1.0, p0[:, None] + np.concatenate([np.zeros((batch, 1)), np.cumsum(inc, 1)[:, :-1]], 1))
  np.testing.assert_allclose(p, expected, rtol=1e-6)


def test_per_row_block_counts_keep_each_row_within_bounds():
  blocks = jnp.array([1, 2, 3, 8], jnp.int32)
  p = np.asarray(block_ratios(jax.random.PRNGKey(1), blocks, 8, Schedule()))
  for row, n in enumerate(np.asarray(blocks)):
    used = p[row, :n]
    assert (np.diff(used) >= 0).all() and used.min() >= 0.2 and used.max() <= 0.7 + 1e-6


def test_configurable_bounds_and_random_ablation():
  p = _ratios("monotone", low=0.1, high=0.9)
  assert p.min() >= 0.1 and p.max() <= 0.9 + 1e-6
  r = _ratios("random")
  assert r.min() >= 0.2 and r.max() <= 0.7
  assert (np.diff(r, axis=1) < 0).any(), "the random ablation is not monotone"
  assert not np.allclose(r, _ratios("monotone"))


def test_bad_schedule_fields_are_named():
  with pytest.raises(ValueError, match="kind"):
    Schedule("cosine")
  with pytest.raises(ValueError, match="low"):
    Schedule(low=0.8, high=0.7)


def test_response_blocks_start_at_each_prompt():
  block, n = response_blocks(jnp.array([3, 0]), 10, 4)
  np.testing.assert_array_equal(block[0], [-1, -1, -1, 0, 0, 0, 0, 1, 1, 1])
  np.testing.assert_array_equal(block[1], [0, 0, 0, 0, 1, 1, 1, 1, 2, 2])
  np.testing.assert_array_equal(n, [2, 3])


def test_masking_touches_only_the_response_at_the_scheduled_rates():
  batch, length, block_size, mask_id = 4096, 24, 4, 99
  prompt_len = jnp.asarray(np.random.default_rng(0).integers(0, 12, batch), jnp.int32)
  tokens = jnp.ones((batch, length), jnp.int32)
  key = jax.random.PRNGKey(7)
  out = noise_batch(key, tokens, prompt_len, block_size=block_size, schedule=Schedule(), mask_token_id=mask_id)
  masked, noised = np.asarray(out.masked), np.asarray(out.tokens)
  positions = np.arange(length)[None]
  prompt = positions < np.asarray(prompt_len)[:, None]
  assert not masked[prompt].any(), "the prompt must stay clean"
  np.testing.assert_array_equal(noised == mask_id, masked)
  np.testing.assert_array_equal(noised[~masked], 1)
  # Recompute the ratios the same way and check per-block empirical rates and the 1/p weights.
  block, num_blocks = response_blocks(prompt_len, length, block_size)
  ratios = np.asarray(block_ratios(jax.random.split(key)[0], num_blocks, -(-length // block_size), Schedule()))
  block = np.asarray(block)
  p = np.take_along_axis(ratios, np.maximum(block, 0), axis=1)
  np.testing.assert_allclose(np.asarray(out.weight)[masked], 1 / p[masked], rtol=1e-6)
  assert (np.asarray(out.weight)[~masked] == 0).all()
  for b in range(3):  # the first blocks exist in every row: mean masked fraction == mean ratio
    sel = block == b
    rate, expected = masked[sel].mean(), p[sel].mean()
    stderr = np.sqrt(expected * (1 - expected) / sel.sum())
    assert abs(rate - expected) < 4 * stderr + 1e-3, (b, rate, expected)
  # Later blocks are masked more (monotone schedule).
  assert masked[block == 0].mean() < masked[block == 2].mean()
