"""Evaluation through the continuous-batching engine: at batch > 1 a sweep's problems flow through S slots
refilled as each finishes, instead of static batches that wait for their slowest row. Greedy scores equal the
batch-1 scores (the engine is batch-invariant); speed is the whole pass's tokens over its wall time.
"""

from __future__ import annotations

import time
from typing import Callable

from d2f_jax.decode import DecodeConfig
from d2f_jax.serve import Engine, EngineConfig, RequestSettings
from d2f_jax.serve.types import ENGINE_METHODS


def engine_fits(config: DecodeConfig, batch_size: int) -> bool:
  """Whether a run goes through the engine: batch > 1 with a method an engine decodes (d2f, threshold, ar,
  llada2; the engine's answer lengths come in whole blocks)."""
  return (batch_size > 1 and any(config.method in methods for methods in ENGINE_METHODS.values())
          and config.max_new_tokens % config.block_size == 0)


def engine_for(model, config: DecodeConfig, slots: int, prompts: list[list[int]]) -> Engine:
  bucket = config.prompt_buckets if isinstance(config.prompt_buckets, int) else min(config.prompt_buckets)
  method = next(engine for engine, methods in ENGINE_METHODS.items() if config.method in methods)
  llada2 = {} if method != "llada2" else dict(steps=config.steps, editing_threshold=config.editing_threshold,
                                              max_post_steps=config.max_post_steps, block_cache=config.block_cache)
  return Engine(model, EngineConfig(slots=slots, method=method, block_size=config.block_size,
                                    max_new_tokens=config.max_new_tokens, max_prompt_len=max(map(len, prompts)),
                                    prompt_bucket=bucket, sampling=config.temperature > 0,
                                    max_blocks_in_flight=config.max_blocks_in_flight,
                                    memory_budget_gib=config.memory_budget_gib, **llada2))


def settings_of(config: DecodeConfig) -> RequestSettings:
  return RequestSettings(method=config.method, max_new_tokens=config.max_new_tokens, tau_add=config.tau_add,
                         tau_act=config.tau_act, tau_conf=config.tau_conf, temperature=config.temperature,
                         top_p=config.top_p, top_k=config.top_k, stop_ids=config.stop_ids)


def warmup_prompts(prompts: list[list[int]], bucket: int, mode: str) -> list[list[int]]:
  """Untimed requests that compile every program the timed pass runs: one per prompt bucket ('shapes'),
  the first prompt ('first') or none."""
  if mode == "none" or not prompts:
    return []
  if mode == "first":
    return prompts[:1]
  by_bucket = {-(-len(p) // bucket): p for p in reversed(prompts)}
  return list(by_bucket.values())


def run_engine(model, prompts: list[list[int]], config: DecodeConfig, slots: int, *, warmup: str = "shapes",
               progress: Callable[[int], None] | None = None) -> dict:
  """Every prompt through an engine of `slots` slots. Returns tokens, forwards and latency (submit to
  finish, queueing included) per prompt, the timed seconds, and the warm-up's requests and seconds."""
  engine = engine_for(model, config, slots, prompts)
  settings = settings_of(config)
  warm = warmup_prompts(prompts, engine.config.prompt_bucket, warmup)
  start = time.perf_counter()
  engine.complete(warm, settings)
  warmup_seconds = time.perf_counter() - start
  finished_at: dict[int, float] = {}
  results: dict[int, object] = {}

  def callback(index):
    def on_event(event):
      if event.finished:
        finished_at[index], results[index] = time.perf_counter(), event.completion
        if progress is not None:
          progress(1)
    return on_event
  start = time.perf_counter()
  for i, prompt in enumerate(prompts):
    engine.submit(prompt, settings, callback(i))
  engine.run_until_idle()
  seconds = time.perf_counter() - start
  return {"tokens": [results[i].tokens for i in range(len(prompts))],
          "forwards": [results[i].forwards for i in range(len(prompts))],
          "latency": [finished_at[i] - start for i in range(len(prompts))], "seconds": seconds,
          "warmup_requests": len(warm), "warmup_seconds": warmup_seconds}
