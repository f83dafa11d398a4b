"""Length-bucketed training batches: each batch is cut to the shortest bucket length its rows fit in.

Rows are prompt + answer + EOS right-padded with EOS to `seq_len`; when most answers are far shorter than
`seq_len`, most of a fixed-length step is padding. With buckets (`config.data.length_buckets`), a row goes
to the smallest bucket holding its used length (the last non-EOS token plus one EOS), each batch is drawn
from one bucket and cut to that bucket's length, so a step computes ~the rows' own lengths (one compiled
program per bucket). What is cut is padding alone: the EOS tokens past the bucket's length. Those carried
loss as response (the model learns to stop), so the objective weighs them less; every row still ends in
at least one EOS.

Every host derives the same plan (from the seed and the epoch, over all rows), so all hosts step with
the same bucket; each takes its own slice of each global batch. Rows are regrouped every epoch; a
bucket's remainder that does not fill a global batch waits for another epoch (drawn anew each time).
"""

from __future__ import annotations

import functools

import grain
import numpy as np

from d2f_jax.train.examples import Examples


def used_lengths(tokens: np.ndarray, eos_id: int) -> np.ndarray:
  """[N] positions a row needs: through its last non-EOS token and one EOS after it (capped at the row)."""
  content = tokens != eos_id  # [N, T]
  last = tokens.shape[1] - 1 - np.argmax(content[:, ::-1], axis=1)  # [N] index of the last non-EOS token
  last = np.where(content.any(axis=1), last, -1)
  return np.minimum(last + 2, tokens.shape[1])


def bucket_lengths(buckets, seq_len: int) -> tuple[int, ...]:
  """The sorted bucket lengths with `seq_len` last (every row fits it)."""
  return tuple(sorted({int(b) for b in buckets} | {int(seq_len)}))


class BucketPlan:
  """Epoch `e`'s global batches: (bucket length, row indices [global_batch]) in a seeded random order."""

  def __init__(self, examples: Examples, *, buckets: tuple[int, ...], eos_id: int, global_batch: int, seed: int):
    self.lengths = bucket_lengths(buckets, examples.tokens.shape[1])
    self.bucket = np.searchsorted(self.lengths, used_lengths(examples.tokens, eos_id))  # [N] bucket index
    self.global_batch, self.seed = global_batch, seed
    counts = np.bincount(self.bucket, minlength=len(self.lengths))
    self.batches_per_epoch = int(np.sum(counts // global_batch))
    if self.batches_per_epoch == 0:
      raise ValueError(f"no length bucket {self.lengths} holds a whole batch of {global_batch} rows (rows per "
                       f"bucket: {counts.tolist()}); use fewer buckets (config.data.length_buckets)")

  @functools.lru_cache(maxsize=2)
  def epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """(bucket length [batches], row indices [batches, global_batch]) of one epoch."""
    rng = np.random.default_rng([self.seed, epoch])
    order = rng.permutation(len(self.bucket))
    lengths, rows = [], []
    for b, length in enumerate(self.lengths):
      members = order[self.bucket[order] == b]
      usable = len(members) // self.global_batch * self.global_batch
      rows.append(members[:usable].reshape(-1, self.global_batch))
      lengths += [length] * (usable // self.global_batch)
    shuffle = rng.permutation(len(lengths))
    return np.asarray(lengths, np.int32)[shuffle], np.concatenate(rows)[shuffle]


def bucketed_dataset(examples: Examples, plan: BucketPlan, *, process_index: int, local_batch: int
                     ) -> grain.MapDataset:
  """Endless batches of this host's rows: batch i is epoch i // batches_per_epoch's batch i % batches_per_epoch,
  its rows [process_index * local_batch, + local_batch) of the global batch, cut to the bucket's length."""

  def batch(index: int, _) -> dict:
    epoch, position = divmod(index, plan.batches_per_epoch)
    lengths, rows = plan.epoch(epoch)
    mine = rows[position, process_index * local_batch:(process_index + 1) * local_batch]  # [local_batch]
    length = int(lengths[position])
    return {"tokens": examples.tokens[mine, :length], "prompt_len": examples.prompt_len[mine]}

  return grain.MapDataset.range(plan.batches_per_epoch).repeat(None).map_with_index(batch)
