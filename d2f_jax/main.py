r"""The main job: D2F reproduced in miniature on a CPU, end to end, with no download.

  python -m d2f_jax.main [--config configs/tiny_e2e.py[:arg]] [--workdir DIR] [--config.field=value ...]

Writes results.md, results.json, throughput_vs_accuracy.png and decode_trace.png into the workdir.
Re-running with the same workdir skips finished stages and resumes unfinished ones.
"""

from __future__ import annotations

import logging
import os

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

_DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "tiny_e2e.py")
_CONFIG = config_flags.DEFINE_config_file("config", _DEFAULT_CONFIG, "Config file, optionally `path.py:arg`.")
_WORKDIR = flags.DEFINE_string("workdir", os.path.join("workdir", "tiny_e2e"), "Output and checkpoint directory.")


def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  absl_logging.set_verbosity(absl_logging.WARNING)
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
  from d2f_jax.e2e import pipeline
  payload = pipeline.run(_CONFIG.value, _WORKDIR.value)
  from d2f_jax.e2e.report import TABLE_COLUMNS
  from d2f_jax.bench.report import format_table
  print(format_table(payload["rows"], TABLE_COLUMNS))
  print(f"results in {os.path.abspath(_WORKDIR.value)}")


if __name__ == "__main__":
  app.run(main)
