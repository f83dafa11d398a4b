"""What is fixed per engine (EngineConfig: slots, shapes, the bound on what a request may ask) and how a
round's admissions become insert calls."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from d2f_jax.serve.types import ENGINE_METHODS

POLICIES = ("latency", "throughput", "auto")
# auto without auto_modes: exact D2F below this many live slots, query_limit from it (the smallest batch of
# bench cost --frontier's table after 1; pass --frontier to take the modes from a measured table).
AUTO_FROM_SLOTS = 8

DEFAULT_MAX_BODY_BYTES = 4 << 20  # the server's request body limit (4 MiB of JSON: far past any prompt it takes)

@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Fixed per engine: shapes and the bound on what a request may ask."""

  slots: int = 32
  method: str = "d2f"  # 'd2f' (requests: d2f or threshold), 'ar' (the causal baseline model) or 'llada2'
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
  # Which mode a request decodes in, chosen when it is admitted and kept to its end (so its answer is its
  # batch-1 decode in that mode): 'latency' exact D2F; 'throughput' query_limit for every request; 'auto' the
  # mode of auto_modes for the live slot count. None: 'throughput' when query_limit is set, else 'latency'.
  policy: str | None = None
  # auto: ((live slots from, q or None for exact), ...) ascending; () = ((AUTO_FROM_SLOTS, query_limit),).
  auto_modes: tuple[tuple[int, int | None], ...] = ()
  # Requests admitted in a query-limited mode also keep their decided positions' K/V (DecodeConfig.cache_decided,
  # a per-row knob); exact-D2F requests stay exact.
  cache_decided: bool = False
  # 'llada2' engines: the released sampler's steps per block (None: one token a step), and LLaDA2.1's token
  # editing: None serves LLaDA2.0's sampler; a threshold compiles the editing loop, each request's default
  # (requests may set their own threshold and post-fill steps, as DecodeConfig's fields).
  steps: int | None = None
  editing_threshold: float | None = None
  max_post_steps: int = 16  # DecodeConfig's default (this module stays free of jax)
  block_cache: bool = False  # llada2: finished blocks' K/V cached, two blocks fed a step (DecodeConfig.block_cache)

  def __post_init__(self):
    for name in ("slots", "block_size", "max_new_tokens", "max_prompt_len", "prompt_bucket", "steps_per_call",
                 "max_insert", "queue_size"):
      value = getattr(self, name)
      if not _positive(value):
        raise ValueError(f"EngineConfig.{name} must be a positive int, got {value!r}")
    if self.method not in ENGINE_METHODS:
      raise ValueError(f"EngineConfig.method must be one of {tuple(ENGINE_METHODS)}, got {self.method!r}")
    if self.max_new_tokens % self.block_size:
      raise ValueError(f"EngineConfig.max_new_tokens ({self.max_new_tokens}) must be a multiple of block_size "
                       f"({self.block_size})")
    for name in ("query_limit", "position_budget"):
      value = getattr(self, name)
      if value is not None and (not _positive(value) or self.method != "d2f"):
        raise ValueError(f"EngineConfig.{name} must be None or a positive int on a 'd2f' engine, got {value!r} "
                         f"(method {self.method!r})")
    if self.method != "llada2" and (self.steps, self.editing_threshold, self.block_cache) != (None, None, False):
      raise ValueError(f"EngineConfig.steps, editing_threshold and block_cache are settings of a 'llada2' engine "
                       f"(method {self.method!r}), got {self.steps!r}, {self.editing_threshold!r} and "
                       f"{self.block_cache!r}")
    self._check_policy()
    if not isinstance(self.cache_decided, bool) or (self.cache_decided and self._compiled_query_limit() is None):
      raise ValueError(f"EngineConfig.cache_decided must be a bool, True only when some request runs a query-limited "
                       f"mode (query_limit or auto_modes with a limit), got {self.cache_decided!r}")

  def _check_policy(self) -> None:
    if self.policy is not None and self.policy not in POLICIES:
      raise ValueError(f"EngineConfig.policy must be one of {POLICIES} or None, got {self.policy!r}")
    for entry in self.auto_modes:
      if (not isinstance(entry, tuple) or len(entry) != 2 or not _positive(entry[0])
          or not (entry[1] is None or _positive(entry[1]))):
        raise ValueError(f"EngineConfig.auto_modes holds (live slots from, query limit or None) pairs of positive "
                         f"ints, got {entry!r}")
    starts = [start for start, _ in self.auto_modes]
    if starts != sorted(set(starts)):
      raise ValueError(f"EngineConfig.auto_modes must ascend strictly by live slots, got {self.auto_modes!r}")
    policy = self.mode_policy
    if self.auto_modes and policy != "auto":
      raise ValueError(f"EngineConfig.auto_modes is the 'auto' policy's table; the policy is {policy!r}")
    if policy == "latency" and self.query_limit is not None:
      raise ValueError(f"EngineConfig.policy 'latency' decodes every request exactly: query_limit must be None, "
                       f"got {self.query_limit!r}")
    if policy in ("throughput", "auto") and self.method != "d2f":
      raise ValueError(f"EngineConfig.policy {policy!r} needs a 'd2f' engine, got method {self.method!r}")
    if policy == "throughput" and self.query_limit is None:
      raise ValueError("EngineConfig.policy 'throughput' decodes every request at query_limit: set query_limit")
    if policy == "auto" and not self.auto_modes and self.query_limit is None:
      raise ValueError("EngineConfig.policy 'auto' needs query_limit (the mode from "
                       f"{AUTO_FROM_SLOTS} live slots) or auto_modes")

  @property
  def mode_policy(self) -> str:
    """The policy in force: `policy`, or by default 'throughput' with query_limit set and 'latency' without."""
    if self.policy is not None:
      return self.policy
    return "throughput" if self.query_limit is not None else "latency"

  @property
  def modes(self) -> tuple[tuple[int, int | None], ...]:
    """((live slots from, query limit or None for exact D2F), ...): the policy as a table."""
    policy = self.mode_policy
    if policy == "latency":
      return ((1, None),)
    if policy == "throughput":
      return ((1, self.query_limit),)
    return self.auto_modes or ((1, None), (AUTO_FROM_SLOTS, self.query_limit))

  def query_limit_at(self, live_slots: int) -> int | None:
    """The query limit of a request admitted with `live_slots` slots decoding (itself included); None: exact."""
    chosen = None
    for start, query_limit in self.modes:
      if live_slots >= start:
        chosen = query_limit
    return chosen

  def decode_config(self):
    """The DecodeConfig whose static spec every program of this engine runs (its compiled paths: method,
    shapes, sampling, the throughput mode); requests bring their own thresholds as knobs. The one builder:
    the engine and its ahead-of-time compile (serve/aot.py) both call it."""
    from d2f_jax.decode.config import DecodeConfig
    return DecodeConfig(method=self.method, block_size=self.block_size, max_new_tokens=self.max_new_tokens,
                        max_blocks_in_flight=self.max_blocks_in_flight, sample=self.sampling,
                        memory_budget_gib=self.memory_budget_gib, query_limit=self._compiled_query_limit(),
                        position_budget=self.position_budget, cache_decided=self.cache_decided, steps=self.steps,
                        editing_threshold=self.editing_threshold, max_post_steps=self.max_post_steps,
                        block_cache=self.block_cache)

  def _compiled_query_limit(self) -> int | None:
    """A query limit whenever some request may run one (the query-limited step is then compiled; each slot's
    own limit is a knob); None when every request decodes exactly."""
    if self.query_limit is not None:
      return self.query_limit
    return max((q for _, q in self.modes if q is not None), default=None)

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


def auto_modes_from_frontier(rows: list[dict], block_size: int, cache_decided: bool = False
                             ) -> tuple[tuple[int, int | None], ...]:
  """The 'auto' policy's table from `bench cost --frontier` rows of one target and model: from each batch on,
  that batch's mode (its query_limit; None: exact D2F). A mode at another block size than the engine's, or
  whose cache_decided differs from the engine's (which its query-limited requests all share), cannot be
  switched to without recompiling: ValueError naming it."""
  if not rows:
    raise ValueError("the frontier has no rows for this target and model")
  modes: list[tuple[int, int | None]] = []
  for row in sorted(rows, key=lambda r: r["batch"]):
    if row.get("block_size") not in (None, block_size):
      raise ValueError(f"the frontier's mode at batch {row['batch']} ({row.get('mode')}) decodes at block size "
                       f"{row['block_size']}, this engine at {block_size}: serve with --block_size "
                       f"{row['block_size']} or choose the modes with --auto_modes")
    query_limit, cached = row.get("query_limit"), bool(row.get("cache_decided"))
    if cached != cache_decided and (cached or query_limit is not None):
      raise ValueError(f"the frontier's mode at batch {row['batch']} ({row.get('mode')}) "
                       f"{'keeps' if cached else 'does not keep'} decided K/V: serve "
                       f"{'with' if cached else 'without'} --cache_decided, or choose the modes with --auto_modes")
    query_limit = block_size if cached and query_limit is None else query_limit
    if not modes or modes[-1][1] != query_limit:
      modes.append((int(row["batch"]), query_limit))
  if modes[0][0] != 1:  # below the table's first batch: exact D2F, the fastest at small batch
    modes[0:1] = [(1, None)] if modes[0][1] is None else [(1, None), modes[0]]
  return tuple(modes)


def _positive(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool) and value > 0


def split_admissions(count: int, sizes: Sequence[int]) -> list[int]:
  """count requests as insert calls of the compiled sizes, largest first and none padded (13, (1, 2, 4, 8)
  -> [8, 4, 1])."""
  chunks = []
  while count:
    chunks.append(max(s for s in sizes if s <= count))
    count -= chunks[-1]
  return chunks
