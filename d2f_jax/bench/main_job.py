"""The main job's models, config and held-out problems, for the benchmarks that run on them (bench serve,
bench serve --versus ar)."""

from __future__ import annotations

import os

from d2f_jax.usage import UsageError

DEFAULT_WORKDIR = os.path.join("workdir", "tiny_e2e")
DEFAULT_CONFIG = "configs/tiny_e2e.py"


def load_config(path_and_arg: str):
  """The main job's config (`--config`, as `python -m d2f_jax.main` takes it); a clear exit when it is missing."""
  from d2f_jax import config_files
  from d2f_jax.train.config import load_config_file
  try:
    return load_config_file(config_files.resolve(path_and_arg))
  except (FileNotFoundError, ValueError) as e:
    raise UsageError(f"--config {path_and_arg}: {e}") from None


def load_student(workdir: str, config: str = DEFAULT_CONFIG):
  """The main job's D2F student and its config; a clear exit when the main job has not been run."""
  import d2f_jax
  path = os.path.join(workdir, "student", "hf")
  if not os.path.isfile(os.path.join(path, "config.json")):
    raise UsageError(f"no trained D2F student in {path}: run `python -m d2f_jax.main --workdir {workdir}` "
                     "first (about 12 minutes on 2 CPU cores), or pass --workdir")
  return d2f_jax.load_model(path), load_config(config)


def held_out_prompts(model, c, limit: int) -> list[list[int]]:
  """The first `limit` held-out problems of the main job's task, encoded by `model`'s tokenizer."""
  from d2f_jax.e2e.pipeline import held_out_task
  from d2f_jax.evals.runner import encode_prompts
  return encode_prompts(model, held_out_task(c).load(limit))
