"""A self-contained tiny distillation setup: a random HF checkpoint with a tokenizer and a question/answer
JSONL over its words, so `configs/tiny.py` exercises the real loading and tokenization paths offline."""

from __future__ import annotations

import os

import numpy as np

from d2f_jax.convert import synthetic
from d2f_jax.models import ModelConfig
from d2f_jax.reporting import write_jsonl


def write_qa_jsonl(path: str, config: ModelConfig, num_examples: int, seed: int, max_words: int = 8) -> str:
  """Questions of 3..max_words random words 'w{i}'; the answer lists them in reverse, each followed by its
  successor word, so answers depend on the whole question (a task that needs the prompt)."""
  rng = np.random.default_rng(seed)
  top = min(config.mask_token_id, config.eos_token_id, config.pad_token_id) - 2
  rows = []
  for _ in range(num_examples):
    words = rng.integers(10, top, size=rng.integers(3, max_words + 1))
    answer = " ".join(f"w{w} w{w + 1}" for w in words[::-1])
    rows.append({"question": " ".join(f"w{w}" for w in words), "answer": answer})
  write_jsonl(path, rows)
  return path


def ensure_synthetic(directory: str, config: ModelConfig, *, num_examples: int, seed: int = 0) -> tuple[str, str]:
  """(model_dir, jsonl_path) under `directory`, written once (float32 weights, seeded) and reused after."""
  model_dir = os.path.join(directory, "model")
  data_path = os.path.join(directory, "qa.jsonl")
  if not os.path.exists(os.path.join(model_dir, "config.json")):
    synthetic.write_hf_checkpoint(model_dir + ".tmp", config, seed=seed, dtype="float32")
    os.replace(model_dir + ".tmp", model_dir)
  if not os.path.exists(data_path):
    write_qa_jsonl(data_path, config, num_examples, seed)
  return model_dir, data_path
