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


STAGE_MODELS = {"student": "D2F student", "ar": "AR baseline"}  # the stages whose models the benchmarks load


def stage_model(workdir: str, stage: str, config: str = DEFAULT_CONFIG):
  """The main job's trained model of `stage` (its hf export); a clear exit when the main job has not made it."""
  import d2f_jax
  path = os.path.join(workdir, stage, "hf")
  if not os.path.isfile(os.path.join(path, "config.json")):
    with_config = "" if config == DEFAULT_CONFIG else f" --config {config}"
    raise UsageError(f"no trained {STAGE_MODELS[stage]} in {path}: run `python -m d2f_jax.main{with_config} "
                     f"--workdir {workdir}` first (about 12 minutes on 2 CPU cores), or pass --workdir")
  return d2f_jax.load_model(path)


def load_student(workdir: str, config: str = DEFAULT_CONFIG):
  """The main job's D2F student and its config."""
  return stage_model(workdir, "student", config), load_config(config)


def warm_engine(model, config, *, slots: int, max_prompt_len: int, steps_per_call: int, max_insert: int,
                method: str = "d2f", query_limit: int | None = None, cache_decided: bool = False):
  """A serving engine for `config`'s decode (block, answer bound, prompt bucket) over `slots` slots, warmed up
  (every program compiled)."""
  from d2f_jax.serve import Engine, EngineConfig
  engine = Engine(model, EngineConfig(slots=slots, method=method, block_size=config.block_size,
                                      max_new_tokens=config.max_new_tokens, max_prompt_len=max_prompt_len,
                                      prompt_bucket=config.prompt_buckets, steps_per_call=steps_per_call,
                                      max_insert=max_insert, query_limit=query_limit,
                                      cache_decided=cache_decided))
  engine.warm_up()
  return engine


def held_out_prompts(model, c, limit: int) -> list[list[int]]:
  """The first `limit` held-out problems of the main job's task, encoded by `model`'s tokenizer."""
  from d2f_jax.e2e.pipeline import held_out_task
  from d2f_jax.evals.runner import encode_prompts
  return encode_prompts(model, held_out_task(c).load(limit))
