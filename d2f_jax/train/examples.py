"""The training row format (`Examples`) and the text -> rows step every text source ends with.

A row is chat_template(user question, generation prompt) + answer + EOS, truncated to `seq_len` and right
padded with EOS. Kept apart from data.py (sources and the grain pipeline) so that the ecosystem sources in
data_sources.py can use it without importing the pipeline that dispatches to them.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from d2f_jax import datafiles as jsonl  # the one JSONL reader (errors name file:line and field)

log = logging.getLogger("d2f_jax.train.data")


@dataclasses.dataclass
class Examples:
  tokens: np.ndarray  # [N, T] int32
  prompt_len: np.ndarray  # [N] int32

  def __post_init__(self):
    if self.tokens.ndim != 2 or self.prompt_len.shape != self.tokens.shape[:1]:
      raise ValueError(f"Examples need tokens [N, T] and prompt_len [N], got {self.tokens.shape} and "
                       f"{self.prompt_len.shape}")
    if len(self.prompt_len) and not ((self.prompt_len >= 0) & (self.prompt_len < self.tokens.shape[1])).all():
      raise ValueError(f"every prompt_len must lie in [0, {self.tokens.shape[1]}) so each row has a response")

  def __len__(self) -> int:
    return len(self.prompt_len)

  def __getitem__(self, index: int) -> dict:
    return {"tokens": self.tokens[index], "prompt_len": self.prompt_len[index]}

  def slice(self, start: int, stop: int | None = None) -> "Examples":
    return Examples(self.tokens[start:stop], self.prompt_len[start:stop])


def read_jsonl(path: str, question_field: str, answer_field: str) -> list[tuple[str, str]]:
  """(question, answer) pairs of a JSONL file; errors name the line and the missing field."""
  try:
    rows = jsonl.read_jsonl(path, (question_field, answer_field))
  except ValueError as e:
    if "field" not in str(e):
      raise
    raise ValueError(f"{e}; set config.data.question_field / answer_field") from None
  return [(row[question_field], row[answer_field]) for row in rows]


def tokenize_pairs(pairs, tokenizer, seq_len: int, eos_id: int) -> Examples:
  """Chat-templated prompt + answer + EOS, truncated / EOS-padded to `seq_len`. Rows whose prompt leaves no
  room for a response are dropped (and counted in the log)."""
  tokens = np.full((len(pairs), seq_len), eos_id, np.int32)
  prompt_len = np.zeros((len(pairs),), np.int32)
  kept = 0
  for question, answer in pairs:
    prompt = list(tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                                tokenize=True, return_dict=False))
    if len(prompt) >= seq_len:
      continue
    row = (prompt + list(tokenizer(answer, add_special_tokens=False)["input_ids"]) + [eos_id])[:seq_len]
    tokens[kept, :len(row)] = row
    prompt_len[kept] = len(prompt)
    kept += 1
  if kept < len(pairs):
    log.warning("dropped %d of %d examples whose prompt fills seq_len=%d", len(pairs) - kept, len(pairs), seq_len)
  return Examples(tokens[:kept], prompt_len[:kept])


def tokenize_with(pairs, data_cfg, tokenizer_dir: str, eos_id: int) -> Examples:
  """tokenize_pairs with the tokenizer saved in `tokenizer_dir` (every text source's last step)."""
  from d2f_jax.convert.source import load_tokenizer
  tokenizer = load_tokenizer(tokenizer_dir)
  if tokenizer is None:
    raise FileNotFoundError(f"no tokenizer in {tokenizer_dir!r}; set config.data.tokenizer")
  return tokenize_pairs(pairs, tokenizer, data_cfg.seq_len, eos_id)
