"""The CPU ceiling of D2F over AR, measured in the run: how fast D2F could be here if a decode were its forwards.

ceiling = tokens per forward x (AR step ms) / (D2F step ms at the row's mean window width)

Both step costs are timed on the run's own models at batch 1 (decode/forward_probes.py: the loop's step alone,
compiled once, then carried over `REPEATS` calls), the D2F one at the compiled widths around the measured mean
window and interpolated between them. On a compute-bound CPU a D2F forward over 2-3 blocks costs several AR
forwards, so the ceiling sits far below the tokens per forward; the measured ratio (`speedup_vs_ar`) sits
below the ceiling by what each generate call adds (prefill, dispatch, host preparation).
"""

from __future__ import annotations

import math

from d2f_jax.decode.forward_probes import StepShape, forward_probe, time_ms
from d2f_jax.decode.widths import ms_at_width
from d2f_jax.e2e.evaluation import decode_block_size
from d2f_jax.e2e.projection import window_blocks

REPEATS = 200
PROMPT_WIDTH = 64  # the main job's prompt bucket (e2e/evaluation.decode_rows)


def prompt_width(rows: list[dict]) -> int:
  """The prompt bucket of the rows' mean prompt (64 for the default task's 26 tokens and the long variant's
  53), so a task of longer prompts has its steps timed against the cache its rows decoded with."""
  mean = max((r.get("prompt_tokens_mean") or 0.0 for r in rows), default=0.0)
  return max(1, -(-int(round(mean)) // PROMPT_WIDTH)) * PROMPT_WIDTH


def step_ms(model, kind: str, width: int, c, repeats: int = REPEATS, prompt: int = PROMPT_WIDTH) -> float:
  shape = StepShape(kind, batch=1, prompt=prompt, new_tokens=c.max_new_tokens, block_size=decode_block_size(c),
                    width=width)
  return time_ms(forward_probe(model, shape), repeats)


def add_ceiling(rows: list[dict], models: dict, c, repeats: int = REPEATS) -> dict:
  """Time the AR step and the student's D2F step at the widths the d2f rows used; set each d2f row's
  `ceiling_vs_ar` (and `step_ms_at_width`); returns the step timings for results.json."""
  d2f_rows = [r for r in rows if r["method"] == "d2f" and r.get("mean_window_blocks")]
  if not d2f_rows or "ar" not in models or not any(r["method"] == "ar" for r in rows):
    return {}
  prompt = prompt_width(rows)
  ar_ms = step_ms(models["ar"], "ar_step", 1, c, repeats, prompt)
  block = decode_block_size(c)
  blocks = c.max_new_tokens // block
  widths = sorted({min(max(w, 1), blocks) for r in d2f_rows for w in (math.floor(window_blocks(r, block)),
                                                                      math.ceil(window_blocks(r, block)))})
  d2f_ms = {w: step_ms(models["student"], "d2f_step", w, c, repeats, prompt) for w in widths}
  for row in d2f_rows:
    row["step_ms_at_width"] = ms_at_width(d2f_ms, window_blocks(row, block))
    row["ceiling_vs_ar"] = row["tokens_per_forward"] * ar_ms / row["step_ms_at_width"]
  return {"ar_step_ms": ar_ms, "d2f_step_ms": d2f_ms, "repeats": repeats, "prompt_width": prompt}


def ceiling_text(rows: list[dict], steps: dict) -> list[str]:
  """results.md lines: the ceiling beside the measured ratio, for each d2f row."""
  if not steps:
    return []
  lines = ["## CPU ceiling of D2F over AR (measured in this run)", "",
           f"An AR step costs {steps['ar_step_ms']:.3f} ms and a D2F step " + ", ".join(
               f"{ms:.3f} ms at {w} block{'s' if w > 1 else ''}" for w, ms in sorted(steps['d2f_step_ms'].items()))
           + " (batch 1, the loop's step alone, each the mean of "
           f"{steps['repeats']} calls after a compile). Ceiling = tokens/fwd x AR step ms / D2F step ms at the "
           "row's mean window (interpolated): what D2F over AR would be if a generate call were its forwards. "
           "The measured ratio adds each call's prefill, dispatch and host preparation.", ""]
  for row in rows:
    if row.get("ceiling_vs_ar"):
      measured = row.get("speedup_vs_ar")
      lines.append(f"- d2f {row['settings']}: {row['tokens_per_forward']:.2f} tokens/fwd, window "
                   f"{row['mean_window_blocks']:.2f} blocks = {row['step_ms_at_width']:.3f} ms -> ceiling "
                   f"{row['ceiling_vs_ar']:.2f}x AR; measured {measured:.2f}x" if measured else
                   f"- d2f {row['settings']}: ceiling {row['ceiling_vs_ar']:.2f}x AR")
  return lines + [""]
