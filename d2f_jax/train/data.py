"""Question/answer data -> fixed-length token rows with per-row prompt lengths, through grain.

A row is chat_template(user question, generation prompt) + answer + EOS, truncated to `seq_len` and right
padded with EOS (padding is response: the student learns to stop). Sources are pluggable (`SOURCES`): each
returns `Examples`; the grain pipeline on top shards by host, reshuffles every epoch by seed, batches, and
exposes an iterator whose position is a small JSON dict saved with every checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Callable

import grain
import jax
import numpy as np

from d2f_jax.train import buckets
from d2f_jax.train.examples import Examples, read_jsonl, tokenize_pairs, tokenize_with  # noqa: F401  (public here)

log = logging.getLogger(__name__)


def _cache_key(path: str, data_cfg, tokenizer_dir: str) -> str:
  stat = os.stat(path)
  text = json.dumps([os.path.abspath(path), stat.st_size, stat.st_mtime_ns, data_cfg.seq_len, data_cfg.question_field,
                     data_cfg.answer_field, os.path.abspath(tokenizer_dir)])
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def jsonl_source(path: str, data_cfg, *, tokenizer_dir: str, eos_id: int, cache_dir: str | None) -> Examples:
  """Tokenized JSONL, cached as .npz under `cache_dir` (keyed by file, tokenizer and settings)."""
  cache = os.path.join(cache_dir, f"{_cache_key(path, data_cfg, tokenizer_dir)}.npz") if cache_dir else None
  if cache and os.path.exists(cache):
    with np.load(cache) as z:
      return Examples(z["tokens"], z["prompt_len"])
  examples = tokenize_with(read_jsonl(path, data_cfg.question_field, data_cfg.answer_field), data_cfg,
                           tokenizer_dir, eos_id)
  if cache:
    os.makedirs(cache_dir, exist_ok=True)
    tmp = f"{cache}.{os.getpid()}.tmp.npz"
    np.savez(tmp, tokens=examples.tokens, prompt_len=examples.prompt_len)
    os.replace(tmp, cache)
  return examples


def npz_source(path: str, data_cfg, **_) -> Examples:
  """Pre-tokenized rows: an .npz with `tokens` [N, seq_len] and `prompt_len` [N]."""
  with np.load(path) as z:
    if "tokens" not in z or "prompt_len" not in z:
      raise ValueError(f"{path}: an npz source needs arrays 'tokens' and 'prompt_len', found {sorted(z)}")
    examples = Examples(z["tokens"].astype(np.int32), z["prompt_len"].astype(np.int32))
  if examples.tokens.shape[1] != data_cfg.seq_len:
    raise ValueError(f"{path}: rows have length {examples.tokens.shape[1]}, config.data.seq_len={data_cfg.seq_len}")
  return examples


def _ecosystem(name: str) -> Callable[..., Examples]:
  """A source from train/data_sources.py, imported when used (tfds and datasets are heavy)."""
  def read(*args, **kwargs) -> Examples:
    from d2f_jax.train import data_sources
    return getattr(data_sources, name)(*args, **kwargs)
  return read


SOURCES: dict[str, Callable[..., Examples]] = {"jsonl": jsonl_source, "npz": npz_source,
                                               "tfds": _ecosystem("tfds_source"),
                                               "hf_datasets": _ecosystem("hf_datasets_source")}


def register_source(name: str, fn: Callable[..., Examples]) -> None:
  """Add a data source: fn(path, data_cfg, *, tokenizer_dir, eos_id, cache_dir) -> Examples."""
  SOURCES[name] = fn


def load_examples(data_cfg, *, tokenizer_dir: str, eos_id: int, cache_dir: str | None) -> tuple[Examples, Examples]:
  """(train, eval) examples; eval is `eval_path` or the last `eval_examples` rows of `path`."""
  if data_cfg.source not in SOURCES:
    raise ValueError(f"config.data.source={data_cfg.source!r} is unknown; known: {sorted(SOURCES)}")
  read = lambda p: SOURCES[data_cfg.source](p, data_cfg, tokenizer_dir=tokenizer_dir, eos_id=eos_id,  # noqa: E731
                                            cache_dir=cache_dir)
  train = read(data_cfg.path)
  if data_cfg.eval_path:
    return train, read(data_cfg.eval_path)
  held = data_cfg.eval_examples
  if held == 0:
    return train, train.slice(0, 0)
  if held >= len(train):
    raise ValueError(f"config.data.eval_examples={held} leaves no training data ({len(train)} examples)")
  return train.slice(0, len(train) - held), train.slice(len(train) - held)


def _host_shard(examples: Examples) -> grain.MapDataset:
  """This process's equal share of the rows (the remainder is left out so all hosts step together)."""
  count = jax.process_count()
  usable = len(examples) // count * count
  return grain.MapDataset.source(examples)[jax.process_index():usable:count]


def train_dataset(examples: Examples, local_batch: int, seed: int, prefetch: int = 2, *,
                  length_buckets: tuple[int, ...] = (), eos_id: int | None = None) -> grain.IterDataset:
  """Endless batches of this host's rows, reshuffled each epoch (deterministic in seed and epoch). With
  `length_buckets`, each batch is cut to the shortest bucket its rows fit in (train/buckets.py)."""
  if length_buckets:
    if eos_id is None:
      raise ValueError("length_buckets need eos_id: a row's used length ends at its padding")
    plan = buckets.BucketPlan(examples, buckets=tuple(length_buckets), eos_id=eos_id,
                              global_batch=local_batch * jax.process_count(), seed=seed)
    ds = buckets.bucketed_dataset(examples, plan, process_index=jax.process_index(), local_batch=local_batch)
  else:
    ds = _host_shard(examples)
    if len(ds) < local_batch:
      raise ValueError(f"{len(ds)} training rows per host cannot fill a per-host batch of {local_batch}")
    ds = ds.shuffle(seed=seed).repeat(None).batch(local_batch, drop_remainder=True)
  return ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=prefetch))


def eval_batches(examples: Examples, local_batch: int, max_batches: int) -> list[dict]:
  """Fixed eval batches of this host's rows, in file order."""
  ds = _host_shard(examples).batch(local_batch, drop_remainder=True)
  return [ds[i] for i in range(min(len(ds), max_batches))]


class DataIterator:
  """A grain iterator with a checkpointable position."""

  def __init__(self, dataset: grain.IterDataset):
    self._it = iter(dataset)

  def __next__(self) -> dict:
    return next(self._it)

  def get_state(self) -> dict:
    return self._it.get_state()

  def set_state(self, state: dict) -> None:
    self._it.set_state(state)
