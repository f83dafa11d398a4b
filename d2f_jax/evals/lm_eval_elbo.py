"""Log-likelihood of a continuation for a masked-diffusion model: the Monte Carlo ELBO LLaDA evaluates with.

A masked-diffusion LM has no left-to-right factorisation, so log p(target | prefix) is bounded from below
by E_l E_mask [ (L / l) * sum over the l masked target positions of log p(x_i | prefix, unmasked target) ]
with l uniform on 1..L and the l positions drawn uniformly (LLaDA, eq. 6 / its lm-eval loglikelihood).
With L = 1 the bound is exact. Masks are drawn on the host from a seeded numpy generator, so a request's
value is reproducible; rows are left-padded to a bucket so similar lengths share one compiled forward.
"""

from __future__ import annotations

import numpy as np


def _bucket(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def masked_elbo(model, prefix: list[int], target: list[int], *, samples: int = 32, seed: int = 0, batch: int = 16,
                bucket: int = 64) -> tuple[float, bool]:
  """(ELBO estimate of log p(target | prefix), whether the one-step argmax with the whole target masked is
  the target). model: a d2f_jax.Model (bidirectional logits); samples: Monte Carlo draws of (l, mask)."""
  import jax

  if not target:
    raise ValueError("masked_elbo: the continuation encodes to no tokens")
  if samples < 1 or batch < 1:
    raise ValueError(f"masked_elbo: samples and batch must be positive, got {samples}, {batch}")
  mask_id = model.config.mask_token_id
  n_prefix, n_target = len(prefix), len(target)
  width = _bucket(n_prefix + n_target, bucket)
  rng = np.random.default_rng(seed)
  counts = rng.integers(1, n_target + 1, size=samples)  # l per draw: [S]
  masked = np.zeros((samples + 1, n_target), bool)  # [S + 1, L]; the last row masks the whole target
  for s, l in enumerate(counts):
    masked[s, rng.choice(n_target, size=int(l), replace=False)] = True
  masked[samples] = True
  target_row = np.asarray(target, np.int32)  # [L]
  rows = np.full((samples + 1, width), mask_id, np.int32)  # [S + 1, W], left padding
  rows[:, width - n_target - n_prefix:width - n_target] = np.asarray(prefix, np.int32)
  rows[:, width - n_target:] = np.where(masked, mask_id, target_row[None, :])
  valid = np.zeros((samples + 1, width), np.int32)
  valid[:, width - n_target - n_prefix:] = 1
  log_probs = np.zeros((samples + 1, n_target))  # [S + 1, L]: log p(target_i) at each target position
  argmax = np.zeros((samples + 1, n_target), np.int64)
  for start in range(0, samples + 1, batch):
    stop = min(start + batch, samples + 1)
    chunk = np.zeros((batch, width), np.int32)  # a fixed batch shape: one compile per width
    chunk_valid = np.zeros((batch, width), np.int32)
    chunk[:stop - start], chunk_valid[:stop - start] = rows[start:stop], valid[start:stop]
    chunk_valid[stop - start:] = valid[0]  # filler rows: a copy of row 0's layout, results dropped
    chunk[stop - start:] = rows[0]
    logits = model.logits(chunk, attention_mask=chunk_valid, mode="bidirectional")[:, width - n_target:]  # [b, L, V]
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = np.take_along_axis(np.asarray(logp), target_row[None, :, None], axis=-1)[..., 0]  # [b, L]
    log_probs[start:stop] = picked[:stop - start]
    argmax[start:stop] = np.asarray(logits.argmax(-1))[:stop - start]
  weights = n_target / counts  # [S]
  elbo = float(np.mean(weights * np.sum(np.where(masked[:samples], log_probs[:samples], 0.0), axis=-1)))
  greedy = bool(np.all(argmax[samples] == target_row))
  return elbo, greedy
