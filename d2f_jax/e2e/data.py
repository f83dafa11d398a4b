"""The arithmetic task as training files: a saved tokenizer and pre-tokenized npz rows.

Rows are prompt + solution + EOS, right-padded with EOS to `seq_len` (padding is response, as in D2F
training: the model learns to stop), with per-row prompt lengths; the trainers' `npz` source reads them.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np

from d2f_jax.tasks import arithmetic, tokenizer


def write_tokenizer(directory: str) -> str:
  tok = tokenizer.build_tokenizer()
  if not os.path.exists(os.path.join(directory, "tokenizer.json")):
    tmp = tempfile.mkdtemp(prefix=os.path.basename(directory) + ".tmp-", dir=os.path.dirname(directory) or ".")
    tok.save_pretrained(tmp)
    os.replace(tmp, directory)
  return directory


def encode_rows(problems: list[arithmetic.Problem], seq_len: int) -> tuple[np.ndarray, np.ndarray]:
  """(tokens [N, seq_len] int32, prompt_len [N] int32); a row that does not fit is an error, not a cut."""
  tok = tokenizer.build_tokenizer()
  eos = tokenizer.special_ids()["eos_token_id"]
  tokens = np.full((len(problems), seq_len), eos, np.int32)
  prompt_len = np.zeros((len(problems),), np.int32)
  for i, problem in enumerate(problems):
    prompt = tok(arithmetic.prompt_text(problem.question), add_special_tokens=False)["input_ids"]
    answer = tok(" " + problem.solution, add_special_tokens=False)["input_ids"]
    row = prompt + answer + [eos]
    if len(row) > seq_len:
      raise ValueError(f"problem {i} needs {len(row)} tokens, more than seq_len={seq_len}; raise data.seq_len")
    tokens[i, :len(row)] = row
    prompt_len[i] = len(prompt)
  return tokens, prompt_len


def write_training_data(path: str, *, seed: int, train: int, test: int, seq_len: int, min_steps: int,
                        max_steps: int, style: str = "terse") -> str:
  """The training split as npz (tokens, prompt_len), written atomically once."""
  if os.path.exists(path):
    return path
  problems, _ = arithmetic.split(seed, train, test, min_steps=min_steps, max_steps=max_steps, style=style)
  tokens, prompt_len = encode_rows(problems, seq_len)
  fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp.npz", dir=os.path.dirname(path) or ".")
  with os.fdopen(fd, "wb") as f:
    np.savez(f, tokens=tokens, prompt_len=prompt_len)
  os.replace(tmp, path)
  return path
