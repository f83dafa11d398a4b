"""Reading data files: JSONL (optionally gzipped) with per-line errors, and where benchmark files live.

Benchmarks are read from local files only (no hub download), so a bad line must say which file and line
it is and what was expected; a half-read benchmark would silently change the score.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path
from typing import Iterable

DATA_DIR_ENV = "D2F_DATA_DIR"


def data_dir() -> Path:
  """Where benchmark files (gsm8k_test.jsonl, HumanEval.jsonl.gz) are looked for: $D2F_DATA_DIR, else
  $XDG_DATA_HOME/d2f_jax (~/.local/share/d2f_jax). Nothing is downloaded; the files are the user's."""
  if os.environ.get(DATA_DIR_ENV):
    return Path(os.environ[DATA_DIR_ENV]).expanduser()
  base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
  return Path(base) / "d2f_jax"


def default_path(filename: str) -> str:
  return str(data_dir() / filename)


def read_jsonl(path, required: Iterable[str] = (), *, limit: int | None = None) -> list[dict]:
  """Objects of a JSONL file (`.gz` is decompressed); blank lines are skipped.

  required: fields every object must have, each a string. Raises FileNotFoundError for a missing file and
  ValueError naming `path:line` for invalid JSON, a non-object line or a missing / non-string field.
  """
  path = os.fspath(path)
  if not os.path.isfile(path):
    hint = (f" (benchmark files are looked for in {data_dir()}: set ${DATA_DIR_ENV} or pass the file's path)"
            if os.path.dirname(os.path.abspath(path)) == str(data_dir().absolute()) else "")
    raise FileNotFoundError(f"data file {path!r} does not exist{hint}")
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
