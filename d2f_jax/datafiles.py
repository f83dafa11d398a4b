"""Reading benchmark files: JSONL (optionally gzipped) with per-line errors, and the default data paths.

Benchmarks are read from local files only (no hub download), so a bad line must say which file and line
it is and what was expected; a half-read benchmark would silently change the score.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path
from typing import Iterable

# The repository sits next to ../shared/data (D2F_DATA_DIR overrides it, e.g. on an accelerator host).
_REPO = Path(__file__).resolve().parents[2]


def data_dir() -> Path:
  return Path(os.environ.get("D2F_DATA_DIR") or _REPO.parent / "shared" / "data")


def default_path(filename: str) -> str:
  return str(data_dir() / filename)


def read_jsonl(path, required: Iterable[str] = (), *, limit: int | None = None) -> list[dict]:
  """Objects of a JSONL file (`.gz` is decompressed); blank lines are skipped.

  required: fields every object must have, each a string. Raises FileNotFoundError for a missing file and
  ValueError naming `path:line` for invalid JSON, a non-object line or a missing / non-string field.
  """
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"benchmark file {path!r} does not exist")
  if limit is not None and (not isinstance(limit, int) or limit < 1):
    raise ValueError(f"limit must be a positive int or None, got {limit!r}")
  required = tuple(required)
  opener = gzip.open if path.endswith(".gz") else open
  rows: list[dict] = []
  try:
    with opener(path, "rt", encoding="utf-8") as f:
      for lineno, line in enumerate(f, start=1):
        if limit is not None and len(rows) >= limit:
          break
        if not line.strip():
          continue
        try:
          row = json.loads(line)
        except json.JSONDecodeError as e:
          raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(row, dict):
          raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
        for field in required:
          if field not in row:
            raise ValueError(f"{path}:{lineno}: missing field {field!r} (each line needs {', '.join(required)})")
          if not isinstance(row[field], str):
            raise ValueError(f"{path}:{lineno}: field {field!r} must be a string, got "
                             f"{type(row[field]).__name__}")
        row["_line"] = lineno
        rows.append(row)
  except (OSError, EOFError, UnicodeDecodeError) as e:  # truncated gzip, wrong encoding
    raise ValueError(f"{path}: could not be read as {'gzipped ' if opener is gzip.open else ''}UTF-8 "
                     f"JSONL: {e}") from e
  if not rows:
    raise ValueError(f"{path}: holds no records")
  return rows
