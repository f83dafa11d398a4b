"""The converter's one error family: every refusal of a bad file, config or option is a `ConvertError`.

A CLI catches exactly this type (plus OSError) and prints it as one line with exit status 2; anything else
is a bug and keeps its traceback. Subclasses say which input was wrong.
"""

from __future__ import annotations


class ConvertError(ValueError):
  """An input the converter refuses; the message names the file and the tensor / field / option."""


class CheckpointError(ConvertError):
  """Checkpoint tensors that do not fit the config.json next to them (names, shapes, dtypes), or a weights
  file that cannot be read."""


def one_line(error: BaseException) -> str:
  """The message of `error` on one line (library errors can span several)."""
  text = " ".join(part.strip() for part in str(error).splitlines() if part.strip())
  return text or type(error).__name__
