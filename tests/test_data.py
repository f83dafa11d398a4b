"""Question/answer rows: chat template, EOS padding, truncation, per-host shards, resumable shuffled order."""

import json

import jax
import ml_collections
import numpy as np
import pytest

from d2f_jax.api import load_tokenizer
from d2f_jax.convert.synthetic import write_tokenizer
from d2f_jax.models import TINY_LLADA
from d2f_jax.train import data as data_lib

EOS = TINY_LLADA.eos_token_id


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
  directory = tmp_path_factory.mktemp("tok")
  write_tokenizer(str(directory), TINY_LLADA)
  return str(directory), load_tokenizer(str(directory))


def _data_cfg(path, seq_len=16, eval_examples=2):
  return ml_collections.ConfigDict(dict(source="jsonl", path=str(path), eval_path=None, eval_examples=eval_examples,
                                        question_field="q", answer_field="a", seq_len=seq_len))


def _write(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return path


def test_rows_are_chat_prompt_then_answer_eos_then_eos_padding(tokenizer):
  _, tok = tokenizer
  prompt = list(tok.apply_chat_template([{"role": "user", "content": "w5 w6"}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False))
  ex = data_lib.tokenize_pairs([("w5 w6", "w7 w8 w9")], tok, seq_len=16, eos_id=EOS)
  assert ex.prompt_len[0] == len(prompt) and 5 in prompt and 6 in prompt
  row = ex.tokens[0].tolist()
  assert row[:len(prompt)] == prompt
  assert row[len(prompt):len(prompt) + 4] == [7, 8, 9, EOS]
  assert row[len(prompt) + 4:] == [EOS] * (16 - len(prompt) - 4)


def test_long_answers_are_truncated_and_prompt_only_rows_dropped(tokenizer):
  _, tok = tokenizer
  long_answer = " ".join(f"w{i}" for i in range(10, 40))
  ex = data_lib.tokenize_pairs([("w5", long_answer), (" ".join(["w5"] * 30), "w7")], tok, seq_len=16, eos_id=EOS)
  assert len(ex) == 1 and ex.tokens.shape == (1, 16)
  assert EOS not in ex.tokens[0, ex.prompt_len[0]:].tolist(), "truncated: no room left for EOS"


def test_jsonl_errors_name_line_and_field(tmp_path):
  path = _write(tmp_path / "bad.jsonl", [{"q": "w1", "a": "w2"}, {"question": "w1", "a": "w2"}])
  with pytest.raises(ValueError, match=r"bad.jsonl:2: .*field 'q'.*question_field"):
    data_lib.read_jsonl(str(path), "q", "a")


def test_load_examples_holds_out_the_tail_and_caches(tmp_path, tokenizer):
  tok_dir, _ = tokenizer
  rows = [{"q": f"w{i}", "a": f"w{i + 1} w{i + 2}"} for i in range(10, 20)]
  path = _write(tmp_path / "qa.jsonl", rows)
  cache = tmp_path / "cache"
  train, held = data_lib.load_examples(_data_cfg(path), tokenizer_dir=tok_dir, eos_id=EOS, cache_dir=str(cache))
  assert (len(train), len(held)) == (8, 2)
  assert len(list(cache.iterdir())) == 1
  again, _ = data_lib.load_examples(_data_cfg(path), tokenizer_dir=tok_dir, eos_id=EOS, cache_dir=str(cache))
  np.testing.assert_array_equal(train.tokens, again.tokens)
  with pytest.raises(ValueError, match="data.source"):
    data_lib.load_examples(ml_collections.ConfigDict({**_data_cfg(path).to_dict(), "source": "parquet"}),
                           tokenizer_dir=tok_dir, eos_id=EOS, cache_dir=None)


def test_npz_source_is_pluggable(tmp_path):
  tokens = np.arange(6 * 8, dtype=np.int32).reshape(6, 8)
  np.savez(tmp_path / "rows.npz", tokens=tokens, prompt_len=np.full(6, 2))
  cfg = ml_collections.ConfigDict({**_data_cfg(tmp_path / "rows.npz", seq_len=8).to_dict(), "source": "npz"})
  train, held = data_lib.load_examples(cfg, tokenizer_dir="", eos_id=EOS, cache_dir=None)
  np.testing.assert_array_equal(held.tokens, tokens[4:])
  cfg.seq_len = 16
  with pytest.raises(ValueError, match="seq_len"):
    data_lib.load_examples(cfg, tokenizer_dir="", eos_id=EOS, cache_dir=None)


def _examples(n=10, length=4):
  return data_lib.Examples(np.arange(n, dtype=np.int32)[:, None].repeat(length, 1), np.ones(n, np.int32))


def _ids(batch):
  return batch["tokens"][:, 0].tolist()


def test_shuffle_is_seeded_per_epoch_and_the_position_resumes():
  ds = data_lib.train_dataset(_examples(), local_batch=5, seed=3)
  it = data_lib.DataIterator(ds)
  epochs = [_ids(next(it)) + _ids(next(it)) for _ in range(2)]
  assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(10)), "every row once per epoch"
  assert epochs[0] != epochs[1], "reshuffled each epoch"
  again = data_lib.DataIterator(data_lib.train_dataset(_examples(), local_batch=5, seed=3))
  assert _ids(next(again)) + _ids(next(again)) == epochs[0], "deterministic by seed"
  other = data_lib.DataIterator(data_lib.train_dataset(_examples(), local_batch=5, seed=4))
  assert _ids(next(other)) + _ids(next(other)) != epochs[0]
  state = it.get_state()
  expected = _ids(next(it))
  fresh = data_lib.DataIterator(data_lib.train_dataset(_examples(), local_batch=5, seed=3))
  fresh.set_state(json.loads(json.dumps(state)))  # the position survives a JSON round trip (checkpoint)
  assert _ids(next(fresh)) == expected


def test_hosts_get_disjoint_equal_shards(monkeypatch):
  seen = []
  monkeypatch.setattr(jax, "process_count", lambda: 3)
  for host in range(3):
    monkeypatch.setattr(jax, "process_index", lambda host=host: host)
    batches = data_lib.eval_batches(_examples(n=11), local_batch=3, max_batches=10)
    seen.append(sorted(i for b in batches for i in _ids(b)))
  flat = sum(seen, [])
  assert len(flat) == len(set(flat)) == 9 and all(len(s) == 3 for s in seen)
