"""What every report of this project writes, on the ground floor so evals, bench and e2e share it without
importing each other: the measuring environment, an aligned text table, atomic JSON / JSONL files."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import tempfile
import time
from typing import IO, Callable, Iterable

import jax

def _umask() -> int:
  """The process umask, read without changing it where Linux allows (os.umask would race other threads)."""
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith("Umask:"):
          return int(line.split()[1], 8)
  except (OSError, ValueError):
    pass
  mask = os.umask(0o022)
  os.umask(mask)
  return mask


def atomic_write(path, write: Callable[[IO[str]], None]) -> None:
  """`write(f)` into a temporary file of its own beside `path` (mkstemp), then renamed over `path`.

  Why unique: two processes writing one results file with a shared `<path>.tmp` tore it (invalid JSON) or
  lost the temporary to the other's rename. Now each rename installs one writer's whole file."""
  path = os.fspath(path)
  fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=os.path.dirname(path) or ".")
  try:
    os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; the file gets what open() would give it
    with os.fdopen(fd, "w", encoding="utf-8") as f:
      write(f)
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(OSError):
      os.unlink(tmp)
    raise


def write_text(path, text: str) -> None:
  """Write `text` atomically (see atomic_write)."""
  atomic_write(path, lambda f: f.write(text))


def write_jsonl(path, rows: Iterable[dict]) -> None:
  """Write rows atomically (a crash never leaves half a samples file that looks complete)."""
  def write(f):
    for row in rows:
      f.write(json.dumps(row, ensure_ascii=False) + "\n")
  atomic_write(path, write)


def write_json(path, payload: dict) -> None:
  def write(f):
    json.dump(payload, f, indent=2, ensure_ascii=False)
    f.write("\n")
  atomic_write(path, write)


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
