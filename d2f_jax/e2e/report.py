"""The run's artefacts: results.json, results.md, a throughput-vs-accuracy plot and a decoding-trace picture."""

from __future__ import annotations

import os

import numpy as np

from d2f_jax.bench.report import environment, format_table
from d2f_jax.evals.data import write_json

TABLE_COLUMNS = ["method", "model", "settings", "accuracy", "tokens_per_s", "tokens_per_forward",
                 "latency_ms", "speedup_vs_ar", "speedup_vs_vanilla"]


def add_ratios(rows: list[dict]) -> list[dict]:
  """tokens/s of every row relative to AR decoding and to the teacher's vanilla decoding, same run."""
  by_method = {row["method"]: row for row in rows}
  for row in rows:
    for name, ref in (("ar", "ar"), ("vanilla", "vanilla")):
      base = by_method.get(ref)
      row[f"speedup_vs_{name}"] = (row["tokens_per_s"] / base["tokens_per_s"]
                                   if base and base["tokens_per_s"] else None)
  return rows


def write_results(out_dir: str, rows: list[dict], stages: dict, config: dict) -> dict:
  payload = {"rows": rows, "stages": stages, "config": config, "environment": environment()}
  write_json(os.path.join(out_dir, "results.json"), payload)
  lines = ["# D2F in miniature: results", "",
           f"Held-out problems: {rows[0]['total'] if rows else 0}; measured on {payload['environment']['device']} "
           f"({payload['environment']['cpus']} CPUs), batch 1, compile time excluded.", "",
           "```", format_table(rows, TABLE_COLUMNS), "```", "", "## Training stages", ""]
  for name, stage in stages.items():
    lines.append(f"- {name}: " + ", ".join(f"{k}={_fmt(v)}" for k, v in stage.items()))
  _atomic_write(os.path.join(out_dir, "results.md"), "\n".join(lines) + "\n")
  return payload


def plot_throughput(out_dir: str, rows: list[dict]) -> str:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(6, 4))
  for row in rows:
    ax.scatter(row["tokens_per_s"], row["accuracy"], s=40)
    ax.annotate(f"{row['method']} {row['settings']}".strip(), (row["tokens_per_s"], row["accuracy"]),
                fontsize=7, xytext=(4, 2), textcoords="offset points")
  ax.set_xscale("log")
  ax.set_xlabel("tokens / s (log)")
  ax.set_ylabel("exact match (%)")
  ax.set_title("throughput vs accuracy")
  ax.grid(alpha=0.3)
  path = os.path.join(out_dir, "throughput_vs_accuracy.png")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def plot_trace(out_dir: str, trace: np.ndarray, block_size: int, title: str) -> str:
  """Position x step picture of one D2F decode: a cell is lit at the step its token was accepted."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  trace = np.asarray(trace)
  accepted = trace >= 0
  length = int(np.nonzero(accepted)[0].max()) + 1 if accepted.any() else 1
  steps = int(trace.max()) + 1 if accepted.any() else 1
  grid = np.zeros((steps, length))
  for pos in range(length):
    if trace[pos] >= 0:
      grid[trace[pos], pos] = 1.0
  fig, ax = plt.subplots(figsize=(max(6, length / 8), max(3, steps / 8)))
  ax.imshow(grid, aspect="auto", cmap="Blues", interpolation="nearest", origin="lower")
  for edge in range(block_size, length, block_size):
    ax.axvline(edge - 0.5, color="gray", lw=0.5)
  ax.set_xlabel(f"generated position (blocks of {block_size})")
  ax.set_ylabel("decoding step")
  ax.set_title(title)
  path = os.path.join(out_dir, "decode_trace.png")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def _fmt(value) -> str:
  return f"{value:.4g}" if isinstance(value, float) else str(value)


def _atomic_write(path: str, text: str) -> None:
  tmp = f"{path}.tmp"
  with open(tmp, "w") as f:
    f.write(text)
  os.replace(tmp, path)
