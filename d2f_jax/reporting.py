"""What every report of this project writes, on the ground floor so evals, bench and e2e share it without
importing each other: the measuring environment, an aligned text table, atomic JSON / JSONL files."""

from __future__ import annotations

import json
import os
import platform
import time
from typing import Iterable

import jax

def write_jsonl(path, rows: Iterable[dict]) -> None:
  """Write rows atomically (a crash never leaves half a samples file that looks complete)."""
  path = os.fspath(path)
  tmp = f"{path}.tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    for row in rows:
      f.write(json.dumps(row, ensure_ascii=False) + "\n")
  os.replace(tmp, path)


def write_json(path, payload: dict) -> None:
  path = os.fspath(path)
  tmp = f"{path}.tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(payload, f, indent=2, ensure_ascii=False)
    f.write("\n")
  os.replace(tmp, path)


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
