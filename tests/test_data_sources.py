"""The ecosystem's data formats give the training rows the JSONL source gives for the same file: a TFDS
ArrayRecord dataset (jsonl_to_tfds, read with tfds.data_source, no TensorFlow) and Hugging Face `datasets`
(the JSONL file itself, and a save_to_disk directory), token for token and in order."""

import json

import ml_collections
import numpy as np
import pytest

from d2f_jax.convert import synthetic
from d2f_jax.models import TINY_LLADA
from d2f_jax.train import data
from d2f_jax.train.data_sources import jsonl_to_tfds, split_path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  root = tmp_path_factory.mktemp("sources")
  model = synthetic.write_hf_checkpoint(root / "model", TINY_LLADA, seed=0, dtype="float32")
  # The synthetic tokenizer knows the words w0, w1, ...
  rows = [{"question": f"w{i} w{i + 3} w{2 * i}", "answer": f"w{i + 1} w{3 * i}", "id": i} for i in range(23)]
  path = root / "qa.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  cfg = ml_collections.ConfigDict(dict(seq_len=48, question_field="question", answer_field="answer"))
  reference = data.jsonl_source(str(path), cfg, tokenizer_dir=str(model), eos_id=TINY_LLADA.eos_token_id,
                                cache_dir=None)
  return root, model, path, cfg, reference


def _read(source, path, corpus):
  _, model, _, cfg, _ = corpus
  return data.SOURCES[source](str(path), cfg, tokenizer_dir=str(model), eos_id=TINY_LLADA.eos_token_id,
                              cache_dir=None)


def _same(got, want):
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_array_equal(got.prompt_len, want.prompt_len)


def test_tfds_array_record_gives_the_jsonl_rows(corpus):
  root, _, path, _, reference = corpus
  assert len(reference) == 23 and len(set(map(bytes, reference.tokens))) == 23  # distinct rows: order is checked
  prepared = jsonl_to_tfds(str(path), str(root / "tfds"))
  assert (root / "tfds").is_dir() and prepared.startswith(str(root / "tfds"))
  _same(_read("tfds", prepared, corpus), reference)
  _same(_read("tfds", prepared + ":train", corpus), reference)
  with pytest.raises(ValueError, match="no split 'test'"):
    _read("tfds", prepared + ":test", corpus)
  with pytest.raises(FileNotFoundError, match="not a prepared TFDS dataset directory"):
    _read("tfds", root, corpus)


def test_hf_datasets_file_and_saved_dataset_give_the_jsonl_rows(corpus, tmp_path):
  import datasets
  _, _, path, _, reference = corpus
  _same(_read("hf_datasets", path, corpus), reference)
  rows = [json.loads(line) for line in path.read_text().splitlines()]
  datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "saved"))
  _same(_read("hf_datasets", tmp_path / "saved", corpus), reference)
  with pytest.raises(ValueError, match="config.data.path=.*source hf_datasets"):
    _read("hf_datasets", tmp_path / "nope" / "absent-dataset", corpus)  # not cached offline, not a file


def test_missing_fields_are_named(corpus, tmp_path):
  bad = tmp_path / "bad.jsonl"
  bad.write_text(json.dumps({"prompt": "x", "answer": "y"}) + "\n")
  with pytest.raises(ValueError, match="example 0 has no field 'question'"):
    _read("hf_datasets", bad, corpus)


def test_split_suffix():
  assert split_path("/d/qa/1.0.0:test") == ("/d/qa/1.0.0", "test")
  assert split_path("/d/qa/1.0.0") == ("/d/qa/1.0.0", "train")
  assert split_path("org/name") == ("org/name", "train")
