r"""The main job: D2F reproduced in miniature on a CPU, end to end, with no download.

  python -m d2f_jax.main [--config configs/tiny_e2e.py[:arg]] [--workdir DIR] [--config.field=value ...]
  python -m d2f_jax.main --config configs/tiny_e2e.py:smoke --workdir /tmp/e2e   # the one-minute variant

Writes results.md, results.json, throughput_vs_accuracy.png and decode_trace.png into the workdir, and the
trained models as Hugging Face directories in <workdir>/<stage>/hf (ar, teacher, student). Stage messages,
training and evaluation progress bars go to stderr. Re-running with the same workdir skips finished stages
and resumes unfinished ones. A finished stage whose recorded config differs from the requested one is
refused (exit 2, naming the fields); `--config.rerun=student` (comma-separated stages, or `all`) moves the
named stages aside and trains them again.
"""

from __future__ import annotations

import logging
import os
import sys

from absl import flags
from absl import logging as absl_logging
from d2f_jax import config_files, usage

_DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "tiny_e2e.py")
_CONFIG = config_files.DEFINE_config_file(
    "config", _DEFAULT_CONFIG, "Config file, optionally `path.py:arg` (configs/tiny_e2e.py:smoke: a one-minute run).")
_WORKDIR = flags.DEFINE_string("workdir", os.path.join("workdir", "tiny_e2e"), "Output and checkpoint directory.")


def main(argv) -> None:
  if len(argv) > 1:
    raise usage.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  # absl's handler owns the root logger: keep library chatter (jax, orbax) at WARNING; the stages speak
  # through pipeline.say and the progress bars, on stderr.
  absl_logging.set_verbosity(absl_logging.WARNING)
  logging.getLogger("d2f_jax").setLevel(logging.WARNING)
  from d2f_jax.e2e import pipeline
  from d2f_jax.workdir_lock import WorkdirLocked
  try:
    payload = pipeline.run(_CONFIG.value, _WORKDIR.value)
  # a busy workdir; a finished stage of another config; a config that cannot run (checked before training)
  except (WorkdirLocked, pipeline.StageConfigChanged, pipeline.ConfigError) as e:
    print(f"error: {e}", file=sys.stderr)
    raise SystemExit(2) from None
  except pipeline.StagePreempted as e:  # SIGTERM / a preemption notice: checkpoint saved, not an error of input
    print(f"stopped: {e}", file=sys.stderr)
    raise SystemExit(143) from None
  from d2f_jax.e2e.report import TABLE_COLUMNS, table_rows
  from d2f_jax.reporting import format_table
  print(format_table(table_rows(payload["rows"]), TABLE_COLUMNS))
  print(f"results in {os.path.abspath(_WORKDIR.value)} (results.md, results.json, *.png; models in */hf)")


if __name__ == "__main__":
  usage.run_absl(main, __doc__)
