"""What is fixed per engine (EngineConfig: slots, shapes, the bound on what a request may ask) and how a
round's admissions become insert calls."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from d2f_jax.serve.types import ENGINE_METHODS


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Fixed per engine: shapes and the bound on what a request may ask."""

  slots: int = 32
  method: str = "d2f"  # 'd2f' (requests: d2f or threshold) or 'ar' (the causal baseline model)
  block_size: int = 32
  max_new_tokens: int = 256  # the bound; each request may ask for less (a multiple of block_size)
  max_prompt_len: int = 512
  prompt_bucket: int = 64  # prefill widths: multiples of this up to max_prompt_len
  steps_per_call: int = 8  # D2F steps per device call (it returns early when a slot finishes)
  max_insert: int = 8  # requests prefilled together in one insert call (powers of two up to this, and slots)
  queue_size: int = 4096  # waiting requests beyond the slots; more are refused (QueueFull)
  sampling: bool = False  # compile the sampling path (requests may set temperature > 0)
  max_blocks_in_flight: int | None = None  # the engine's cap; None as the paper
  memory_budget_gib: float | None = None
  query_limit: int | None = None  # d2f throughput mode (DecodeConfig.query_limit); None: the exact loop
  # Positions a step may feed over the live slots (DecodeConfig.position_budget): windows narrow under load.
  # A request's tokens then depend on what shares the engine; None (the default) keeps them invariant.
  position_budget: int | None = None

  def __post_init__(self):
    for name in ("slots", "block_size", "max_new_tokens", "max_prompt_len", "prompt_bucket", "steps_per_call",
                 "max_insert", "queue_size"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"EngineConfig.{name} must be a positive int, got {value!r}")
    if self.method not in ENGINE_METHODS:
      raise ValueError(f"EngineConfig.method must be one of {tuple(ENGINE_METHODS)}, got {self.method!r}")
    if self.max_new_tokens % self.block_size:
      raise ValueError(f"EngineConfig.max_new_tokens ({self.max_new_tokens}) must be a multiple of block_size "
                       f"({self.block_size})")
    for name in ("query_limit", "position_budget"):
      value = getattr(self, name)
      if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0
                                or self.method != "d2f"):
        raise ValueError(f"EngineConfig.{name} must be None or a positive int on a 'd2f' engine, got {value!r} "
                         f"(method {self.method!r})")

  def decode_config(self):
    """The DecodeConfig whose static spec every program of this engine runs (its compiled paths: method,
    shapes, sampling, the throughput mode); requests bring their own thresholds as knobs. The one builder:
    the engine and its ahead-of-time compile (serve/aot.py) both call it."""
    from d2f_jax.decode.config import DecodeConfig
    return DecodeConfig(method=self.method, block_size=self.block_size, max_new_tokens=self.max_new_tokens,
                        max_blocks_in_flight=self.max_blocks_in_flight, temperature=1.0 if self.sampling else 0.0,
                        memory_budget_gib=self.memory_budget_gib, query_limit=self.query_limit,
                        position_budget=self.position_budget)

  @property
  def prompt_width(self) -> int:
    """Every slot's prompt columns P: max_prompt_len rounded up to 8 (sublanes), not to a bucket, since every
    step of every slot attends over P + max_new_tokens cache columns."""
    return -(-self.max_prompt_len // 8) * 8

  @property
  def prompt_buckets(self) -> tuple[int, ...]:
    """Prefill widths: the multiples of prompt_bucket below the prompt width, then the prompt width."""
    return tuple(range(self.prompt_bucket, self.prompt_width, self.prompt_bucket)) + (self.prompt_width,)

  @property
  def insert_sizes(self) -> tuple[int, ...]:
    """Requests per insert call, each its own program: 1, 2, 4, ... up to min(max_insert, slots)."""
    top = min(self.max_insert, self.slots)
    return tuple(1 << i for i in range(top.bit_length()) if 1 << i <= top)

  def bucket(self, prompt_len: int) -> int:
    """The prefill width of a prompt: the smallest of `prompt_buckets` (the widths warm-up compiles) that holds
    it."""
    return next(width for width in self.prompt_buckets if width >= prompt_len)


def split_admissions(count: int, sizes: Sequence[int]) -> list[int]:
  """count requests as insert calls of the compiled sizes, largest first and none padded (13, (1, 2, 4, 8)
  -> [8, 4, 1])."""
  chunks = []
  while count:
    chunks.append(max(s for s in sizes if s <= count))
    count -= chunks[-1]
  return chunks
