"""The standard error of a benchmark score, computed as lm-eval does it, so the two paths are reported alike.

For a score that is the mean of per-problem 0/1 outcomes, lm-eval reports the sample standard deviation
(n - 1 in the denominator) over sqrt(n). With 1319 GSM8K problems at 77 % that is about 1.2 points, so
differences of a point between decoders are within noise; the paper reports none.
"""

from __future__ import annotations

import math
from typing import Iterable


def mean_stderr(outcomes: Iterable[float]) -> float | None:
  """Standard error of the mean of `outcomes` (0/1 or any reals); None for fewer than two."""
  values = [float(v) for v in outcomes]
  n = len(values)
  if n < 2:
    return None
  mean = sum(values) / n
  variance = sum((v - mean) ** 2 for v in values) / (n - 1)
  return math.sqrt(variance / n)


def score_stderr_percent(correct: Iterable[bool]) -> float | None:
  """The standard error of a percentage score (the runner's `score` is 100 * mean(correct))."""
  stderr = mean_stderr(1.0 if c else 0.0 for c in correct)
  return None if stderr is None else 100.0 * stderr
