"""GSM8K: few-shot prompts in the lm-eval-harness layout, answer extraction and exact-match scoring.

The paper scores LLaDA on GSM8K 4-shot through lm-eval, whose prompt is "Question: ...\\nAnswer: ..." blocks
joined by blank lines and whose answer is the number after "#### ". Diffusion decoders fill whole blocks,
so a generation usually runs on into a made-up next question; it is cut at the first stop string before
the answer is read.

Protocol of this built-in fast path (recorded in results.json as task_options.protocol): 4-shot from the
built-in exemplars below (not lm-eval's seeded draw from the train split), plain text (no chat template
unless --chat), this module's stop strings and its answer extraction ('####', 'The answer is', else the
last number). It is not the paper's protocol: for numbers comparable with the D2F paper use the lm-eval
adapter (evals/lm_eval_model.py, task gsm8k_d2f: chat template, few-shot as multi-turn, BOS, 512 tokens).
"""

from __future__ import annotations

import dataclasses
import os
import random
import re
from decimal import Decimal, InvalidOperation

from d2f_jax.datafiles import default_path, read_jsonl

DEFAULT_FILE = "gsm8k_test.jsonl"
FIELDS = ("question", "answer")
# Where a continuation stops being the answer (lm-eval's `until` for gsm8k, plus the end-of-text markers
# of the two model families in case the tokenizer keeps them when decoding).
STOP_STRINGS = ("Question:", "</s>", "<|im_end|>", "<|eot_id|>", "<|endoftext|>")

# Written for this harness in the style of GSM8K train answers (not taken from the test file), so the
# default prompt leaks no test item. Each answer ends with the "#### N" line the extractor looks for.
BUILTIN_EXEMPLARS: tuple[tuple[str, str], ...] = (
    ("A baker makes 24 muffins in the morning and 18 muffins in the afternoon. She sells 35 of them. "
     "How many muffins does she have left?",
     "She makes 24 + 18 = 42 muffins.\nAfter selling 35 she has 42 - 35 = 7 muffins left.\n#### 7"),
    ("Tom buys 3 notebooks at $4 each and a pen for $2. He pays with a $20 bill. How much change does he get?",
     "The notebooks cost 3 * 4 = $12.\nWith the pen he spends 12 + 2 = $14.\n"
     "His change is 20 - 14 = $6.\n#### 6"),
    ("A garden has 5 rows of tomato plants with 8 plants in each row. Each plant gives 6 tomatoes. "
     "How many tomatoes does the garden give?",
     "There are 5 * 8 = 40 plants.\nThey give 40 * 6 = 240 tomatoes.\n#### 240"),
    ("Maria reads 15 pages on Monday, twice as many on Tuesday, and 10 fewer than on Tuesday on Wednesday. "
     "How many pages does she read in the three days?",
     "On Tuesday she reads 15 * 2 = 30 pages.\nOn Wednesday she reads 30 - 10 = 20 pages.\n"
     "In total she reads 15 + 30 + 20 = 65 pages.\n#### 65"),
    ("A train ticket costs $12.50 for an adult and half as much for a child. How much do 2 adults and "
     "3 children pay in total?",
     "A child's ticket costs 12.50 / 2 = $6.25.\nThe adults pay 2 * 12.50 = $25.\n"
     "The children pay 3 * 6.25 = $18.75.\nTogether they pay 25 + 18.75 = $43.75.\n#### 43.75"),
    ("A class of 28 students splits into teams of 4. Each team needs 3 balls. How many balls are needed?",
     "There are 28 / 4 = 7 teams.\nThey need 7 * 3 = 21 balls.\n#### 21"),
    ("Sam saved $150. He spent 20% of it on a game and $45 on shoes. How much money does he have left?",
     "The game cost 150 * 20 / 100 = $30.\nHe spent 30 + 45 = $75 in total.\n"
     "He has 150 - 75 = $75 left.\n#### 75"),
    ("A water tank holds 1,200 liters. It is 3/4 full, and then 250 liters are used. "
     "How many liters are left in the tank?",
     "The tank holds 1200 * 3 / 4 = 900 liters.\nAfter using 250 liters, 900 - 250 = 650 liters are left.\n"
     "#### 650"),
)

# A number as written in a solution: optional minus (not one that joins two numbers, as in "5-3"),
# optional $, digits with thousands commas, optional decimals. A trailing period is not a decimal part.
_NUMBER = re.compile(r"(?<![\w)\]])(-?)\$?(-?)((?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)")
_HASHES = re.compile(r"####")
_ANSWER_IS = re.compile(r"the (?:final )?answer is", re.IGNORECASE)


def normalize_number(text: str) -> str | None:
  """Canonical form of a written number: '$1,234.50' -> '1234.5', '18.00' -> '18', '-0' -> '0'.

  None when `text` holds no number. Decimal arithmetic, so '0.1' stays '0.1' and big integers stay exact.
  """
  match = _NUMBER.search(text.strip())
  if match is None:
    return None
  return _canonical(match)


def _canonical(match: re.Match) -> str | None:
  negative = bool(match.group(1) or match.group(2))
  try:
    value = Decimal(match.group(3).replace(",", ""))
  except InvalidOperation:
    return None
  if negative:
    value = -value
  if value == value.to_integral_value():
    return str(int(value))
  return format(value.normalize(), "f")


def extract_answer(text: str) -> str | None:
  """The model's final answer in `text`, normalised, or None when it holds no number.

  In order: the number after the first '####' (lm-eval's strict match), the number after the first
  'The answer is' on the same line (chain-of-thought exemplars), else the last number in the text.
  """
  for marker in (_HASHES, _ANSWER_IS):
    found = marker.search(text)
    if found:
      rest = text[found.end():].split("\n", 1)[0]
      number = _NUMBER.search(rest)
      if number:
        return _canonical(number)
  numbers = list(_NUMBER.finditer(text))
  return _canonical(numbers[-1]) if numbers else None


def gold_answer(answer: str, *, where: str = "answer") -> str:
  """The reference answer of a GSM8K solution: the number after its '#### '."""
  if "####" not in answer:
    raise ValueError(f"{where}: GSM8K answer has no '#### N' final line: {answer[-80:]!r}")
  value = normalize_number(answer.rsplit("####", 1)[1])
  if value is None:
    raise ValueError(f"{where}: no number after '####' in {answer[-80:]!r}")
  return value


def truncate(text: str, stop_strings: tuple[str, ...] = STOP_STRINGS) -> str:
  """`text` up to the first stop string (the answer to this question, not to a made-up next one)."""
  cut = min((i for i in (text.find(s) for s in stop_strings) if i >= 0), default=len(text))
  return text[:cut].strip()


def format_example(question: str, answer: str | None = None) -> str:
  head = f"Question: {question.strip()}\nAnswer:"
  return head if answer is None else f"{head} {answer.strip()}"


def build_prompt(question: str, exemplars: tuple[tuple[str, str], ...] | list = BUILTIN_EXEMPLARS,
                 n_shot: int = 4) -> str:
  """lm-eval's gsm8k prompt: n_shot solved examples and the question, separated by blank lines."""
  if not 0 <= n_shot <= len(exemplars):
    raise ValueError(f"n_shot must lie in [0, {len(exemplars)}] (the exemplars available), got {n_shot}")
  shots = [format_example(q, a) for q, a in list(exemplars)[:n_shot]]
  return "\n\n".join(shots + [format_example(question)])


def load_exemplars(path: str, n: int, seed: int = 1234) -> list[tuple[str, str, int]]:
  """n (question, answer, line) exemplars drawn from a GSM8K-format file with a fixed seed."""
  rows = read_jsonl(path, FIELDS)
  if n > len(rows):
    raise ValueError(f"{path}: asked for {n} few-shot exemplars but the file holds only {len(rows)}")
  picked = random.Random(seed).sample(range(len(rows)), n)
  return [(rows[i]["question"], rows[i]["answer"], rows[i]["_line"]) for i in picked]


@dataclasses.dataclass
class Gsm8kTask:
  """GSM8K as the runner sees it: items with a prompt and a target, and a scorer.

  path: GSM8K-format JSONL (default: gsm8k_test.jsonl in the data directory, datafiles.data_dir()).
  fewshot_path: draw the exemplars from this file (seeded) instead of the built-in set; when it is the
  evaluated file itself, the drawn items are left out of the evaluation.
  """

  path: str | None = None
  n_shot: int = 4
  fewshot_path: str | None = None
  fewshot_seed: int = 1234

  name = "gsm8k"
  metric = "exact_match"

  def load(self, limit: int | None = None) -> list[dict]:
    path = self.path or default_path(DEFAULT_FILE)
    exemplars, skip = list(BUILTIN_EXEMPLARS), set()
    if self.fewshot_path is not None:
      drawn = load_exemplars(self.fewshot_path, self.n_shot, self.fewshot_seed)
      exemplars = [(q, a) for q, a, _ in drawn]
      if os.path.realpath(self.fewshot_path) == os.path.realpath(path):
        skip = {line for _, _, line in drawn}
    rows = [r for r in read_jsonl(path, FIELDS) if r["_line"] not in skip]
    items = []
    for row in rows[:limit]:
      items.append({"id": f"gsm8k/{row['_line'] - 1}", "question": row["question"],
                    "target": gold_answer(row["answer"], where=f"{path}:{row['_line']}"),
                    "prompt": build_prompt(row["question"], exemplars, self.n_shot)})
    return items

  def score(self, items: list[dict], generations: list[str]) -> list[dict]:
    records = []
    for item, text in zip(items, generations, strict=True):
      kept = truncate(text)
      answer = extract_answer(kept)
      records.append({"id": item["id"], "kept": kept, "extracted": answer, "target": item["target"],
                      "correct": answer is not None and answer == item["target"]})
    return records

  def options(self) -> dict:
    return {"path": self.path or default_path(DEFAULT_FILE), "n_shot": self.n_shot,
            "fewshot": self.fewshot_path or "builtin", "fewshot_seed": self.fewshot_seed,
            "stop_strings": list(STOP_STRINGS),
            "protocol": f"built-in: {self.n_shot}-shot 'Question:/Answer:' blocks from "
                        f"{'the built-in exemplars' if self.fewshot_path is None else 'a seeded draw'}, "
                        "this harness's stop strings and answer extraction; not lm-eval's gsm8k (see "
                        "d2f_jax.evals.lm_eval_model for the paper's protocol)"}
