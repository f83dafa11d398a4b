"""Question-answer data in the ecosystem's formats, beside the project's JSONL and npz (train/data.py):

  config.data.source = "tfds"         a prepared TFDS dataset directory (ArrayRecord), read with
                                      `tfds.data_source`: random access, no TensorFlow needed;
  config.data.source = "hf_datasets"  a Hugging Face `datasets` dataset: a `save_to_disk` directory, a
                                      json / jsonl / parquet / csv file, or a Hub dataset id (the local
                                      cache and HF_DATASETS_OFFLINE are honoured).

`path` (and `eval_path`) may end in ":split" (default "train"). `jsonl_to_tfds` turns the project's QA JSONL
into an ArrayRecord TFDS dataset once, in the file's order. Every source yields the same (question, answer)
pairs, tokenized by the same chat template as the JSONL source.
"""

from __future__ import annotations

import os

from d2f_jax.train.examples import tokenize_with

DEFAULT_SPLIT = "train"
_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def split_path(path: str) -> tuple[str, str]:
  """'dir:split' -> (dir, split); a path without a split suffix reads `train`."""
  head, sep, tail = path.rpartition(":")
  if sep and tail and "/" not in tail and os.sep not in tail:
    return head, tail
  return path, DEFAULT_SPLIT


def _pairs(rows, data_cfg, where: str) -> list[tuple[str, str]]:
  q, a = data_cfg.question_field, data_cfg.answer_field
  pairs = []
  for i, row in enumerate(rows):
    missing = [f for f in (q, a) if f not in row]
    if missing:
      raise ValueError(f"{where}: example {i} has no field {missing[0]!r} (fields: {sorted(row)}); set "
                       "config.data.question_field / answer_field")
    pairs.append(tuple(v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in (row[q], row[a])))
  return pairs


def tfds_source(path: str, data_cfg, *, tokenizer_dir: str, eos_id: int, cache_dir=None):
  """Examples of a prepared TFDS dataset directory (the one holding dataset_info.json)."""
  import tensorflow_datasets as tfds
  directory, split = split_path(path)
  if not os.path.isfile(os.path.join(directory, "dataset_info.json")):
    raise FileNotFoundError(f"config.data.path={path!r}: {directory!r} is not a prepared TFDS dataset directory "
                            "(no dataset_info.json); make one with d2f_jax.train.data_sources.jsonl_to_tfds")
  builder = tfds.builder_from_directory(directory)
  if split not in builder.info.splits:
    raise ValueError(f"config.data.path={path!r}: no split {split!r}; the dataset has {sorted(builder.info.splits)}")
  source = builder.as_data_source(split=split)
  return tokenize_with(_pairs((source[i] for i in range(len(source))), data_cfg, path), data_cfg, tokenizer_dir, eos_id)


def hf_datasets_source(path: str, data_cfg, *, tokenizer_dir: str, eos_id: int, cache_dir=None):
  """Examples of a Hugging Face dataset: a save_to_disk directory, a data file, or a Hub dataset id."""
  import datasets
  location, split = split_path(path)
  try:
    if os.path.isdir(location) and os.path.isfile(os.path.join(location, "dataset_dict.json")):
      rows = datasets.load_from_disk(location)[split]
    elif os.path.isdir(location) and os.path.isfile(os.path.join(location, "dataset_info.json")):
      rows = datasets.load_from_disk(location)
    elif os.path.isfile(location):
      builder = _FILE_BUILDERS.get(os.path.splitext(location)[1])
      if builder is None:
        raise ValueError(f"a data file must be one of {sorted(_FILE_BUILDERS)}")
      rows = datasets.load_dataset(builder, data_files={split: location}, split=split, cache_dir=cache_dir)
    else:
      rows = datasets.load_dataset(location, split=split, cache_dir=cache_dir)  # a Hub id
  except Exception as e:  # missing file, unknown split, not cached offline: one line naming the path
    raise ValueError(f"config.data.path={path!r} (source hf_datasets): {type(e).__name__}: "
                     f"{str(e).splitlines()[0] if str(e) else ''}") from e
  return tokenize_with(_pairs(rows, data_cfg, path), data_cfg, tokenizer_dir, eos_id)


def jsonl_to_tfds(jsonl_path: str, data_dir: str, *, name: str = "d2f_qa", split: str = DEFAULT_SPLIT,
                  question_field: str = "question", answer_field: str = "answer") -> str:
  """Write a QA JSONL as an ArrayRecord TFDS dataset under `data_dir` (examples in file order); returns the
  prepared dataset directory that `config.data.path` names for source 'tfds'."""
  import tensorflow_datasets as tfds
  from d2f_jax import datafiles as jsonl
  rows = jsonl.read_jsonl(jsonl_path, (question_field, answer_field))

  class Builder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    VERSION = tfds.core.Version("1.0.0")
    code_path = None  # a class made here has no source file of its own (tfds would look one up)

    def _info(self):
      features = tfds.features.FeaturesDict({question_field: tfds.features.Text(), answer_field: tfds.features.Text()})
      return tfds.core.DatasetInfo(builder=self, features=features, disable_shuffling=True,
                                   description=f"QA pairs from {os.path.abspath(jsonl_path)}")

    def _split_generators(self, dl_manager):
      return {split: self._generate_examples()}

    def _generate_examples(self):
      for i, row in enumerate(rows):
        yield i, {question_field: str(row[question_field]), answer_field: str(row[answer_field])}

  Builder.name = name
  builder = Builder(data_dir=data_dir, file_format="array_record")
  builder.download_and_prepare()
  return os.fspath(builder.data_dir)
