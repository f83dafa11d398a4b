"""A GSM8K-style task generated from a seed: multi-step word problems with a worked solution.

Each problem chains 1-4 operations (a configurable range) on one quantity (buy, give away, boxes of,
double, share) with small numbers, so a model of a few hundred thousand parameters can learn it on a
CPU in minutes, while the worked solution (one equation per step, then "So the answer is N.") spans several decoding blocks.

Two solution styles over the same problems (the same seed draws the same numbers and questions in both):
  terse (the default, the main job's): "5 + 3 = 8. 8 * 2 = 16. So the answer is 16."
  verbose (long answers, for pipelining over many blocks): the start state, then per step the question's
    sentence, its equation and the new state: "Tom has 5 apples. Then gets 3 more apples. 5 + 3 = 8. Tom has
    8 apples. Then the number doubles. 8 * 2 = 16. Tom has 16 apples. So the answer is 16." Every equation's
    operands sit in the sentences just before it, so a long chain stays learnable by a tiny model; the only
    far look-up is which question sentence comes next. Only words the tokenizer already has are used.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

NAMES = ("Tom", "Ann", "Ben", "Lia", "Sam", "Eva", "Max", "Zoe")
ITEMS = ("apples", "pens", "cards", "eggs", "books", "coins", "shells", "stamps")
STYLES = ("terse", "verbose")  # worked-solution formats; terse is the default (module docstring)


@dataclasses.dataclass(frozen=True)
class Problem:
  question: str
  solution: str  # worked steps ending in "So the answer is <answer>."
  answer: int


def _step(rng: np.random.Generator, value: int, item: str) -> tuple[str, str, int]:
  """One operation on `value`: (question sentence, solution sentence, new value). Values stay in 0..99."""
  while True:
    kind = rng.integers(5)
    if kind == 0:
      k = int(rng.integers(1, 10))
      if value + k < 100:
        return f"Then gets {k} more {item}.", f"{value} + {k} = {value + k}.", value + k
    elif kind == 1 and value > 1:
      k = int(rng.integers(1, min(value, 10)))
      return f"Then gives away {k} {item}.", f"{value} - {k} = {value - k}.", value - k
    elif kind == 2:
      n, m = int(rng.integers(2, 6)), int(rng.integers(2, 6))
      if value + n * m < 100:
        return (f"Then buys {n} boxes with {m} {item} each.",
                f"{n} * {m} = {n * m}. {value} + {n * m} = {value + n * m}.", value + n * m)
    elif kind == 3 and 0 < value < 50:
      return "Then the number doubles.", f"{value} * 2 = {value * 2}.", value * 2
    elif kind == 4 and value >= 2 and value % 2 == 0:
      return f"Then gives half of the {item} away.", f"{value} / 2 = {value // 2}.", value // 2


def make_problem(rng: np.random.Generator, min_steps: int = 2, max_steps: int = 4, style: str = "terse") -> Problem:
  """One problem; `style` changes only the solution's text, never the random draws (so the problems match)."""
  name = NAMES[rng.integers(len(NAMES))]
  item = ITEMS[rng.integers(len(ITEMS))]
  value = int(rng.integers(2, 20))
  question = [f"{name} has {value} {item}."]
  verbose = style == "verbose"
  solution = [question[0]] if verbose else []
  for _ in range(int(rng.integers(min_steps, max_steps + 1))):
    q, s, value = _step(rng, value, item)
    question.append(q)
    solution += [q, s, f"{name} has {value} {item}."] if verbose else [s]
  question.append(f"How many {item} does {name} have now?")
  solution.append(f"So the answer is {value}.")
  return Problem(" ".join(question), " ".join(solution), value)


def make_problems(count: int, seed: int, *, min_steps: int = 2, max_steps: int = 4, style: str = "terse"
                  ) -> list[Problem]:
  """`count` problems, identical for the same seed on every machine (numpy's PCG64 stream)."""
  if count < 0 or not 1 <= min_steps <= max_steps:
    raise ValueError(f"need count >= 0 and 1 <= min_steps <= max_steps, got {count}, {min_steps}, {max_steps}")
  if style not in STYLES:
    raise ValueError(f"style must be one of {STYLES}, got {style!r}")
  rng = np.random.default_rng(seed)
  return [make_problem(rng, min_steps, max_steps, style) for _ in range(count)]


def split(seed: int, train: int, test: int, **kw) -> tuple[list[Problem], list[Problem]]:
  """Disjoint train / held-out problems: held-out questions never appear in the training set."""
  pool = make_problems(train + 4 * test + 64, seed, **kw)
  seen, train_set, test_set = set(), [], []
  for problem in pool:
    if len(train_set) < train:
      train_set.append(problem)
      seen.add(problem.question)
    elif problem.question not in seen and len(test_set) < test:
      test_set.append(problem)
  if len(test_set) < test:
    raise ValueError(f"could not draw {test} held-out problems distinct from the {train} training ones")
  return train_set, test_set


def extract_answer(text: str) -> int | None:
  """The integer after the last 'the answer is', or None."""
  marker = "the answer is"
  lowered = text.lower()
  if marker not in lowered:
    return None
  tail = lowered.rsplit(marker, 1)[1].strip().split(" ")[0].rstrip(".")
  try:
    return int(tail)
  except ValueError:
    return None


@functools.lru_cache(maxsize=4)
def _held_out(seed: int, train: int, test: int, min_steps: int, max_steps: int, style: str) -> tuple[Problem, ...]:
  """The held-out problems of a split, drawn once per process (every decoding row reads them)."""
  return tuple(split(seed, train, test, min_steps=min_steps, max_steps=max_steps, style=style)[1])


@dataclasses.dataclass
class ArithmeticTask:
  """The held-out split as an evaluation task (the protocol of `d2f_jax.evals.runner`).

  The defaults are the main job's (configs/tiny_e2e.py: seed 0, 30000 training problems, 256 held out,
  1-2 operations, terse solutions), so `python -m d2f_jax.evaluate --task arithmetic` scores the set its table
  reports; `style` only changes the solutions, so the prompts and answers are the same in both styles.
  """

  seed: int = 0
  train: int = 30000
  test: int = 256
  min_steps: int = 1
  max_steps: int = 2
  style: str = "terse"

  name = "arithmetic"
  metric = "exact_match"

  def load(self, limit: int | None = None) -> list[dict]:
    held_out = _held_out(self.seed, self.train, self.test, self.min_steps, self.max_steps, self.style)
    return [{"id": f"arithmetic/{i}", "prompt": prompt_text(p.question), "target": p.answer}
            for i, p in enumerate(held_out[:limit])]

  def score(self, items: list[dict], generations: list[str]) -> list[dict]:
    records = []
    for item, text in zip(items, generations, strict=True):
      answer = extract_answer(text)
      records.append({"id": item["id"], "kept": text, "extracted": answer, "target": item["target"],
                      "correct": answer == item["target"]})
    return records

  def options(self) -> dict:
    return dataclasses.asdict(self)


def prompt_text(question: str) -> str:
  """The miniature's prompt format. No colons: the WordPiece decoder's clean-up rejoins " ." and " ?" but
  not " :", and prompts must decode back to exactly this text."""
  return f"Question {question} Answer"
