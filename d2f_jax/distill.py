r"""Asymmetric distillation from the command line.

  python -m d2f_jax.distill --config configs/llada_8b.py:tpu_v5p_64 --workdir /mnt/shared/runs/llada \
      --config.model.path=/ckpt/LLaDA-8B-Instruct --config.data.path=/data/qa.jsonl

`--config` takes a config file and its `get_config` argument after ':'; `--config.a.b=v` overrides a field.
Re-running with the same workdir resumes from its newest checkpoint. Multi-host runs need the workdir on a
filesystem every host sees (NFS, Filestore, a gcsfuse mount of a bucket).
"""

from __future__ import annotations

import logging

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file, optionally `path.py:arg`.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and the exported adapter.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  # absl (and orbax through it) logs every checkpoint step at INFO: keep those to warnings, ours at INFO.
  absl_logging.set_verbosity(absl_logging.WARNING)
  logging.getLogger("d2f_jax").setLevel(logging.INFO)
  from d2f_jax.train import config as config_lib, sharding
  config = _CONFIG.value
  config_lib.validate(config)
  sharding.maybe_initialize_distributed(config.distributed)  # before anything touches the devices
  from d2f_jax.train.trainer import Trainer
  trainer = Trainer(config, _WORKDIR.value)
  history = trainer.run()
  trainer.close()
  if history:
    last = history[-1]
    summary = {k: round(v, 5) for k, v in last.items() if k != "step"}
    logging.getLogger("d2f_jax").info("done at step %d: %s", last["step"], summary)


if __name__ == "__main__":
  app.run(main)
