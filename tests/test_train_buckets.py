"""Length-bucketed training batches (train/buckets.py): each batch cut to the shortest bucket its rows fit in,
only padding cut, every host on the same bucket, regrouped per epoch, resumable; and a Trainer run on them."""

import json
import os

import jax
import numpy as np
import pytest

from d2f_jax.train import buckets
from d2f_jax.train import config as config_lib
from d2f_jax.train import data as data_lib
from d2f_jax.train.examples import Examples
from d2f_jax.train.trainer import Trainer

EOS = 3
SEQ = 32


def _examples(n=60, seed=0) -> Examples:
  """Rows of prompt 4 + answer of 2..26 tokens (ids >= 10, row id in column 0) + EOS, EOS-padded to SEQ."""
  rng = np.random.default_rng(seed)
  tokens = np.full((n, SEQ), EOS, np.int32)
  for i in range(n):
    used = 4 + int(rng.integers(2, 27))
    tokens[i, :used] = rng.integers(10, 50, size=used)
    tokens[i, 0] = 100 + i
  return Examples(tokens, np.full((n,), 4, np.int32))


def _row_ids(batch) -> list[int]:
  return (np.asarray(batch["tokens"])[:, 0] - 100).tolist()


def test_used_length_is_the_last_non_eos_token_plus_one_eos():
  tokens = np.array([[5, 6, EOS, EOS, EOS, EOS],   # answer 2 tokens then padding: 3 used
                     [5, EOS, 7, EOS, EOS, EOS],   # an EOS inside the answer does not end it: 4 used
                     [5, 6, 7, 8, 9, 9],           # truncated, no EOS: the whole row
                     [5, 6, 7, 8, 9, EOS]])        # ends exactly in its one EOS
  assert buckets.used_lengths(tokens, EOS).tolist() == [3, 4, 6, 6]


def test_each_batch_is_cut_to_the_shortest_bucket_its_rows_fit_and_only_padding_is_cut():
  ex = _examples()
  used = buckets.used_lengths(ex.tokens, EOS)
  it = data_lib.DataIterator(data_lib.train_dataset(ex, local_batch=4, seed=1, length_buckets=(12, 20),
                                                    eos_id=EOS))
  lengths = set()
  for _ in range(40):
    batch = next(it)
    length = batch["tokens"].shape[1]
    rows = _row_ids(batch)
    lengths.add(length)
    bucket = [min(b for b in (12, 20, SEQ) if b >= u) for u in used[rows]]
    assert set(bucket) == {length}, (length, used[rows])
    np.testing.assert_array_equal(batch["tokens"], ex.tokens[rows, :length])
    assert (ex.tokens[rows, length:] == EOS).all()
  assert lengths == {12, 20, SEQ}


def test_epochs_hold_each_row_at_most_once_regrouped_and_deterministic():
  ex = _examples()
  plan = buckets.BucketPlan(ex, buckets=(12, 20), eos_id=EOS, global_batch=4, seed=1)
  counts = np.bincount(plan.bucket, minlength=3)
  assert plan.batches_per_epoch == int(np.sum(counts // 4))
  first, second = plan.epoch(0)[1], plan.epoch(1)[1]
  for rows in (first, second):
    assert len(set(rows.ravel().tolist())) == rows.size  # no row twice in an epoch
    assert rows.size >= len(ex) - 3 * 3  # at most global_batch - 1 rows left out per bucket
  assert {frozenset(r) for r in first.tolist()} != {frozenset(r) for r in second.tolist()}  # regrouped
  again = buckets.BucketPlan(ex, buckets=(20, 12), eos_id=EOS, global_batch=4, seed=1)
  np.testing.assert_array_equal(again.epoch(1)[1], second)
  other = buckets.BucketPlan(ex, buckets=(12, 20), eos_id=EOS, global_batch=4, seed=2)
  assert not np.array_equal(other.epoch(0)[1], first)


def test_the_position_resumes_from_its_json_state():
  ex = _examples()
  make = lambda: data_lib.DataIterator(data_lib.train_dataset(ex, 4, 1, length_buckets=(12, 20),  # noqa: E731
                                                              eos_id=EOS))
  it = make()
  for _ in range(17):  # past the end of the first epoch
    next(it)
  state = json.loads(json.dumps(it.get_state()))
  expected = [next(it) for _ in range(3)]
  fresh = make()
  fresh.set_state(state)
  for want in expected:
    got = next(fresh)
    np.testing.assert_array_equal(got["tokens"], want["tokens"])


def test_hosts_step_with_the_same_bucket_on_disjoint_rows(monkeypatch):
  ex = _examples()
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  per_host = []
  for host in range(2):
    monkeypatch.setattr(jax, "process_index", lambda host=host: host)
    it = data_lib.DataIterator(data_lib.train_dataset(ex, 3, 5, length_buckets=(12, 20), eos_id=EOS))
    per_host.append([next(it) for _ in range(8)])  # the first epoch's 8 batches
  plan = buckets.BucketPlan(ex, buckets=(12, 20), eos_id=EOS, global_batch=6, seed=5)
  assert plan.batches_per_epoch == 8
  for i, (a, b) in enumerate(zip(*per_host)):
    assert a["tokens"].shape == b["tokens"].shape == (3, plan.epoch(0)[0][i])
    assert sorted(_row_ids(a) + _row_ids(b)) == sorted(plan.epoch(0)[1][i].tolist())


def test_a_bucket_plan_without_a_whole_batch_is_refused_naming_the_field():
  with pytest.raises(ValueError, match="config.data.length_buckets"):
    buckets.BucketPlan(_examples(n=5), buckets=(12, 20), eos_id=EOS, global_batch=8, seed=0)
  with pytest.raises(ValueError, match="eos_id"):
    data_lib.train_dataset(_examples(), 4, 0, length_buckets=(12,))


class _Recorder:
  """A data iterator that notes each batch's length."""

  def __init__(self, inner):
    self.inner, self.lengths = inner, set()

  def __next__(self):
    batch = next(self.inner)
    self.lengths.add(batch["tokens"].shape[1])
    return batch

  def get_state(self):
    return self.inner.get_state()


def _tiny(**overrides):
  c = config_lib.load_config_file(os.path.join(os.path.dirname(__file__), "..", "configs", "tiny.py")
                                  + ":objective=ar,random,runlocal")
  c.update(dict(total_steps=6, log_every=1, eval_every=1000, progress_bar=False, export=False))
  c.data.update(dict(synthetic_examples=96, eval_examples=8))
  c.checkpoint.update(dict(every=2, keep=4))
  c.update_from_flattened_dict(overrides)
  return c


@pytest.mark.parametrize("bad, match", [((8,), "block_size"), ((72,), "data.seq_len"), ((40,), "loss_chunk")])
def test_bad_bucket_lengths_are_refused_naming_the_field(bad, match):
  c = _tiny(**{"data.length_buckets": bad, "loss_chunk": 16 if match == "loss_chunk" else 0})
  with pytest.raises(ValueError, match=f"data.length_buckets.*{match}"):
    config_lib.validate(c)


def test_a_bucketed_run_trains_on_cut_batches_and_resumes_with_the_same_losses(tmp_path):
  """The synthetic rows (questions of 3-8 words, answers twice as long) use 20-50 of the 64 positions; buckets
  (32, 48) make some steps 32 or 48 long, and a run stopped after step 4 resumes to the same losses."""
  c = _tiny(**{"data.length_buckets": (32, 48)})
  whole = Trainer(c, str(tmp_path / "whole"))
  whole.data = _Recorder(whole.data)
  history = whole.run()
  lengths = whole.data.lengths
  whole.close()
  assert lengths and lengths <= {32, 48, 64} and lengths != {64}, lengths
  expected = {h["step"]: h["loss"] for h in history if "loss" in h}
  first = Trainer(c, str(tmp_path / "parts"))
  first.run(num_steps=4)
  first.close()
  resumed = Trainer(c, str(tmp_path / "parts"))
  rest = {h["step"]: h["loss"] for h in resumed.run() if "loss" in h}
  resumed.close()
  assert rest == {k: v for k, v in expected.items() if k > 4}
  positions = [h["tokens_per_s"] for h in history if "tokens_per_s" in h]
  assert all(p > 0 for p in positions)


def test_bench_train_main_job_steps_the_same_rows_whole_and_bucketed(tmp_path):
  """`bench train --main_job`: a row per stage, the bucketed batches shorter than seq_len; a config without
  buckets is refused naming the field."""
  from d2f_jax.bench import train_buckets
  from test_e2e import _config
  c = _config("smoke")
  with pytest.raises(ValueError, match="config.length_buckets"):
    train_buckets.measure(c, 2, str(tmp_path / "none"))
  c.length_buckets = (32, 48)  # the default task's rows use 20-49 of the 80 positions
  rows = train_buckets.measure(c, 3, str(tmp_path / "bench"))
  assert [r["stage"] for r in rows] == ["ar", "teacher", "student"]
  for row in rows:
    assert row["whole_len"] == 80 and 32 <= row["bucketed_mean_len"] < 80
    assert row["whole_ms"] > 0 and row["bucketed_ms"] > 0
