"""HumanEval: completion prompts, post-processing of generations and pass@1 by executing the tests.

A diffusion decoder writes whole blocks, so a completion rarely ends where the function does: it runs on
into test code, a `__main__` block or a markdown fence. Post-processing keeps the function and drops the
rest. The candidate sandbox runs `prompt + completion`; a separate judge sandbox runs the prompt's own
helpers and the tests and calls `check` on the candidate's entry point across the sandbox boundary, so the
verdict is the judge's, not the completion's exit status (evals/sandbox/core.py has the threat model).

Protocol (the built-in fast path): the prompt is the problem's own prompt (completion style, no chat
template, no few-shot), one greedy or sampled generation per problem (pass@1), human-eval's truncation.
"""

from __future__ import annotations

import dataclasses
import re

from d2f_jax.datafiles import default_path, read_jsonl
from d2f_jax.evals.sandbox import Sandbox, TestProgram

DEFAULT_FILE = "HumanEval.jsonl.gz"
FIELDS = ("task_id", "prompt", "canonical_solution", "test", "entry_point")

_FENCE = re.compile(r"```[ \t]*([\w+-]*)[ \t]*\n")
_DEF = re.compile(r"(?:async\s+)?def\s+(\w+)\s*\(")


def load_problems(path: str | None = None, limit: int | None = None) -> list[dict]:
  """HumanEval problems from a JSONL(.gz) file with task_id, prompt, canonical_solution, test, entry_point."""
  path = path or default_path(DEFAULT_FILE)
  problems = read_jsonl(path, FIELDS, limit=limit)
  seen = set()
  for p in problems:
    if p["task_id"] in seen:
      raise ValueError(f"{path}:{p['_line']}: duplicate task_id {p['task_id']!r}")
    seen.add(p["task_id"])
    if not p["entry_point"].isidentifier():
      raise ValueError(f"{path}:{p['_line']}: entry_point {p['entry_point']!r} is not a Python identifier")
  return problems


def strip_fences(text: str) -> str:
  """The code inside the first markdown fence (```python, ```py or bare ```), else `text` unchanged.

  An unclosed fence (the generation hit its length limit) keeps everything after the opening line.
  """
  opening = _FENCE.search(text)
  if opening is None:
    return text.replace("```", "")
  body = text[opening.end():]
  closing = body.find("```")
  return body if closing < 0 else body[:closing]


def _is_top_level(line: str) -> bool:
  return bool(line.strip()) and not line[0].isspace()


def truncate_completion(text: str, entry_point: str | None = None) -> str:
  """The part of a generation that belongs to the function, human-eval style.

  Body mode (the usual continuation of the prompt's signature and docstring, indented): everything up to
  the first top-level line (`def`, `class`, `if __name__`, `print`, a comment, ...). Full mode (the
  first code line is top level, as chat models write a whole function, often fenced): leading imports,
  helpers and the definition of `entry_point`, up to the next top-level line after that definition.
  """
  lines = strip_fences(text).replace("\r\n", "\n").split("\n")
  first = next((line for line in lines if line.strip()), "")
  if not _is_top_level(first):  # body mode
    end = next((i for i, line in enumerate(lines) if _is_top_level(line)), len(lines))
    return "\n".join(lines[:end]).rstrip() + "\n"
  kept, seen_entry = [], False
  for line in lines:
    if _is_top_level(line):
      definition = _DEF.match(line)
      if seen_entry:
        break
      if definition:
        seen_entry = definition.group(1) == entry_point
      elif not line.startswith(("import ", "from ", "class ", "@")):
        break
    kept.append(line)
  return "\n".join(kept).rstrip() + "\n"


def defines_entry_point(completion: str, entry_point: str) -> bool:
  return any(m.group(1) == entry_point for m in (_DEF.match(l) for l in completion.split("\n")) if m)


def candidate_source(problem: dict, completion: str) -> str:
  """What the candidate sandbox runs: prompt + completion.

  A completion that redefines the entry point (full mode) follows a `pass` that closes the prompt's
  own definition, so the prompt's imports and helpers stay and the completion's definition wins.
  """
  prompt = problem["prompt"]
  if defines_entry_point(completion, problem["entry_point"]):
    prompt = prompt.rstrip("\n") + "\n    pass\n\n"
  return f"{prompt}{completion}\n"


def build_test(problem: dict, completion: str) -> TestProgram:
  """The sandboxed test: the candidate defines the entry point; the judge runs the prompt (its helpers,
  e.g. HumanEval/38's encode_cyclic, with the entry point left as its docstring stub) and the tests."""
  tests = f"{problem['prompt']}\n\n{problem['test']}\n"
  return TestProgram(candidate=candidate_source(problem, completion), tests=tests,
                     entry_point=problem["entry_point"])


def build_program(problem: dict, completion: str) -> str:
  """The classic single program (prompt + completion + tests + check), for reading or an unjudged run."""
  return f"{candidate_source(problem, completion)}\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


@dataclasses.dataclass
class HumanEvalTask:
  """HumanEval as the runner sees it: the prompt is the problem's own prompt (completion style)."""

  path: str | None = None
  sandbox: Sandbox | None = None
  workers: int = 2

  name = "humaneval"
  metric = "pass@1"

  def __post_init__(self):
    self.sandbox = self.sandbox or Sandbox()

  def load(self, limit: int | None = None) -> list[dict]:
    return [{"id": p["task_id"], "prompt": p["prompt"], "problem": p} for p in load_problems(self.path, limit)]

  def score(self, items: list[dict], generations: list[str]) -> list[dict]:
    completions = [truncate_completion(g, item["problem"]["entry_point"])
                   for item, g in zip(items, generations, strict=True)]
    tests = [build_test(item["problem"], c) for item, c in zip(items, completions)]
    results = self.sandbox.run_many(tests, self.workers)
    return [{"id": item["id"], "kept": c, "extracted": None, "target": None, "correct": r.passed,
             "status": r.status, "reason": r.reason, "exec_seconds": round(r.seconds, 3)}
            for item, c, r in zip(items, completions, results)]

  def options(self) -> dict:
    return {"path": self.path or default_path(DEFAULT_FILE), "workers": self.workers,
            "sandbox": self.sandbox.describe(),
            "protocol": "built-in: the problem's prompt as is (no chat template, no few-shot), human-eval "
                        "style truncation of the completion, pass@1 from one generation per problem"}
