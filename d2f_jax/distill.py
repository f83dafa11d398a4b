r"""Asymmetric distillation from the command line.

  python -m d2f_jax.distill --config configs/llada_8b.py:tpu_v5p_64 --workdir /mnt/shared/runs/llada \
      --config.model.path=/ckpt/LLaDA-8B-Instruct --config.data.path=/data/qa.jsonl

`--config` takes a config file and its `get_config` argument after ':'; `--config.a.b=v` overrides a field.
Re-running with the same workdir resumes from its newest checkpoint. Multi-host runs need the workdir on a
filesystem every host sees (NFS, Filestore, a gcsfuse mount of a bucket).

Exit status (what a scheduler / the launch scripts act on):
  0    done: config.total_steps reached, final checkpoint (and export) written
  2    refused input: a bad config field, data file or model directory, or a workdir whose checkpoints
       were written with an incompatible config (one `error:` line naming the field), or a workdir another
       live process works in (named by pid and host); nothing overwritten; or a checkpoint that could not
       be written (disk full: the path and errno; partial files removed, older checkpoints intact)
  3    diverged: a non-finite loss, gradient or parameter; no checkpoint or export of that state
  143  preempted: stopped by SIGTERM (or a preemption notice) after saving the checkpoint of the step it
       finished; run the same command again to resume
  other  a crash (traceback); the newest intact checkpoint is resumed on the next run
"""

from __future__ import annotations

import logging
import sys

from absl import flags
from absl import logging as absl_logging
from d2f_jax import config_files, usage

_CONFIG = config_files.DEFINE_config_file("config", None, "Config file, optionally `path.py:arg`. Required.",
                                           lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and the exported adapter. Required.")
flags.mark_flags_as_required(["config", "workdir"])

EXIT_BAD_INPUT = 2
EXIT_DIVERGED = 3
EXIT_PREEMPTED = 143  # 128 + SIGTERM: what a shell reports for a process SIGTERM killed


def _fail(code: int, error: BaseException) -> None:
  message = " ".join(str(error).split()) or type(error).__name__
  print(f"error: {message}", file=sys.stderr)
  raise SystemExit(code)


def main(argv) -> None:
  if len(argv) > 1:
    raise usage.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  # absl (and orbax through it) logs every checkpoint step at INFO: keep those to warnings, ours at INFO.
  absl_logging.set_verbosity(absl_logging.WARNING)
  logging.getLogger("d2f_jax").setLevel(logging.INFO)
  from d2f_jax.convert.errors import ConvertError
  from d2f_jax.train.checkpoint import CheckpointMismatch, CheckpointWriteError, CorruptCheckpoints
  from d2f_jax.workdir_lock import WorkdirLocked
  from d2f_jax.train.divergence import NonFiniteError
  from d2f_jax.train.trainer import Trainer
  config = _CONFIG.value
  try:  # the Trainer validates the config, then starts jax.distributed before anything touches the devices
    trainer = Trainer(config, _WORKDIR.value)
  except (ConvertError, CheckpointMismatch, CorruptCheckpoints, FileNotFoundError, ValueError, WorkdirLocked) as e:
    # a config field, data file, model directory or workdir that cannot be used (or is busy)
    raise usage.UsageError(str(e) or type(e).__name__) from None
  try:
    history = trainer.run()
  except NonFiniteError as e:
    trainer.close()
    _fail(EXIT_DIVERGED, e)
  except CheckpointWriteError as e:  # disk full, permissions: the path and errno, partial files removed
    try:
      trainer.close()
    except CheckpointWriteError:
      pass
    _fail(EXIT_BAD_INPUT, e)
  trainer.close()
  log = logging.getLogger("d2f_jax")
  if history:
    last = history[-1]
    summary = {k: round(v, 5) for k, v in last.items() if k != "step"}
    log.info("%s at step %d: %s", "preempted" if trainer.preempted else "done", last["step"], summary)
  if trainer.preempted:
    log.warning("exiting with status %d (preempted, checkpoint saved): rerun to resume", EXIT_PREEMPTED)
    raise SystemExit(EXIT_PREEMPTED)


if __name__ == "__main__":
  usage.run_absl(main, __doc__)
