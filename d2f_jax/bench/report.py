"""Shared output of every benchmark: an aligned text table on stdout and a JSON file."""

from __future__ import annotations

import os
import platform
import time

import jax

from d2f_jax.evals.data import write_json


def environment() -> dict:
  """What the numbers were measured on, stored beside them."""
  device = jax.devices()[0]
  return {"backend": jax.default_backend(), "device": getattr(device, "device_kind", str(device)),
          "device_count": jax.device_count(), "cpus": os.cpu_count(), "python": platform.python_version(),
          "jax": jax.__version__, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def format_table(rows: list[dict], columns: list[str] | None = None) -> str:
  columns = columns or list(rows[0])
  def cell(value):
    if isinstance(value, float):
      return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"
    return str(value)
  text = [[cell(row.get(c, "")) for c in columns] for row in rows]
  widths = [max(len(c), *(len(r[i]) for r in text)) for i, c in enumerate(columns)]
  lines = [" | ".join(c.ljust(w) for c, w in zip(columns, widths)), "-+-".join("-" * w for w in widths)]
  lines += [" | ".join(v.ljust(w) for v, w in zip(r, widths)) for r in text]
  return "\n".join(lines)


def write_report(path: str, name: str, rows: list[dict], **extra) -> None:
  """Print the table and write {name, environment, rows, **extra} as JSON to `path` (atomically)."""
  print(format_table(rows))
  directory = os.path.dirname(path)
  if directory:
    os.makedirs(directory, exist_ok=True)
  write_json(path, {"benchmark": name, "environment": environment(), "rows": rows, **extra})
  print(f"wrote {path}")
