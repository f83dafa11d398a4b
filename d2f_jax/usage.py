"""A refused command-line input, the same way in every CLI: one `error: ...` line on stderr, exit status 2
(what argparse uses), never a traceback. `str()` of the exception is the message, so callers and tests that
run `main()` in-process can still read it."""

from __future__ import annotations

import sys

EXIT_BAD_INPUT = 2


class UsageError(SystemExit):
  def __init__(self, message: str):
    super().__init__(EXIT_BAD_INPUT)
    self.message = " ".join(str(message).split())  # one line
    print(f"error: {self.message}", file=sys.stderr, flush=True)

  def __str__(self) -> str:
    return self.message
