"""Decoding configuration: what the user sets, split into a static spec (shapes, code paths) and knobs.

Only the static spec is a jit argument that recompiles; thresholds, temperature, top-p and stop tokens are
traced `Knobs`, so sweeping them (or changing prompts within a length bucket) reuses one compiled loop.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from d2f_jax.decode.config_checks import MAX_STOP_IDS, SettingError, check
from d2f_jax.decode.methods import Method, check_method_fits
from d2f_jax.decode.widths import query_widths_for, window_widths_for
from d2f_jax.models import ModelConfig

DreamAlg = Literal["confidence", "entropy", "margin"]


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """How to decode. Defaults are the paper's D2F settings (tau_conf 0.9, tau_add 0.1, tau_act 0.95).

  method: 'd2f' pipelined block decoding with a KV cache; 'threshold' = d2f with tau_add 1 and one block
    in flight (training-free threshold decoding with a prefix cache, Fast-dLLM style); 'vanilla' = LLaDA
    semi-autoregressive low-confidence remasking (no cache, `steps` spread evenly over the blocks);
    'dream_vanilla' = Dream's whole-response ordering by `alg` in `steps` steps; 'llada2' = LLaDA2's own
    block sampler (decode/block_sampler.py; `steps` per block, threshold tau_conf); 'ar' = KV-cached
    next-token decoding that treats the model as a causal LM (causal attention, row i predicts token i+1).
  max_blocks_in_flight: a cap on the blocks decoding at once (d2f), or None for no cap, as in the authors'
    loop (the default: a cap changes which tokens come out, so it is a speed option, not a default).
    The window of a forward holds the blocks in flight plus the finished ones whose K/V it writes, at most
    min(cap + 1, max_new_tokens / block_size) blocks.
  window_widths: compiled window widths in blocks; each step runs the smallest that holds every block in
    flight of every row (one `lax.switch` in the jitted loop: static shapes, no recompiles, the same tokens).
    None: 1, 2, 3, 4, 5, 9, 17, ...: every width up to 4 blocks (where most steps run), then 1 + 2^k (2^k in
    flight plus one awaiting its cache write); () the largest window only, which is always compiled.
  stop_ids: ids that end a row; None means the model's eos and end-of-turn ids, () never stops early.
  prompt_buckets: prompt lengths are padded up to a multiple of this int, or to the smallest length in
    this tuple that fits, so prompts within a bucket share one compiled program.
  memory_budget_gib: checked before anything compiles (d2f_jax.decode.limits), with the positions the
    model was trained for and the prompt ids.
  query_limit: a throughput mode of d2f / threshold (decode/query_window.py), None (the default) = off, the
    authors' loop. With q, a forward feeds of each block in flight only its decided positions and its first
    q still-masked ones (the later masks are left out of the forward, so they are neither computed nor
    attended), Fast-dLLM v2's sub-block inside D2F's pipeline: fewer positions a step, different tokens.
  position_budget: a throughput mode for load (vLLM's max_num_batched_tokens), None = off. A step whose
    live rows would feed more positions in all than this narrows every row's q (halving from the block
    size) until they fit or q is 1; runs the query-limited step (q = the block size without query_limit,
    the exact tokens while the budget holds). A row's tokens then depend on what shares its batch.
  editing_threshold: 'llada2' only; None (the default) = LLaDA2.0's sampler. LLaDA2.1's token editing
    (its released generate): each step also rewrites a decided response token of the current block with the
    model's choice when that differs and its probability exceeds this (T2T), accepts at least one mask (those
    above tau_conf, else the most confident; `steps` is unused), and after the block's last mask runs until
    a step edits nothing, at most `max_post_steps` more forwards. The model card's modes: quality tau_conf
    0.7 / editing 0.5, speed 0.5 / 0.0 (0.0: rewrite whenever the choice differs).
  block_cache: 'llada2' only, False (the default) = the released loop, which recomputes the whole sequence
    every step. True keeps finished blocks' K/V (exact under block-causal attention) and feeds two blocks a
    step: greedy tokens equal but for float near-ties, sampling draws other random numbers.
  cache_decided: a throughput mode of d2f / threshold, False (the default) = off. A position decided in a
    block in flight is fed once more, with its token, and its K/V is kept in the cache from then on instead
    of being fed every step; the kept K/V is approximate (the rest of its block changed since) until the
    block completes and is fed whole, which writes the exact K/V (Fast-dLLM's approximate cache inside
    D2F's pipeline). Runs the query-limited step (q = query_limit, or the block size).
  """

  method: Method = "d2f"
  block_size: int = 32
  max_new_tokens: int = 256
  max_blocks_in_flight: int | None = None
  window_widths: tuple[int, ...] | None = None
  tau_add: float = 0.1
  tau_act: float = 0.95
  tau_conf: float = 0.9
  temperature: float = 0.0
  top_p: float = 1.0
  top_k: int = 0  # sample among the k most probable tokens only; 0: off
  steps: int | None = None  # vanilla / dream_vanilla (all), llada2 (per block); None: one token per step
  alg: DreamAlg = "confidence"
  stop_ids: tuple[int, ...] | None = None
  prompt_buckets: int | tuple[int, ...] = 64
  memory_budget_gib: float | None = None  # KV cache + weights must fit; None: the decoding devices' memory
  query_limit: int | None = None  # d2f: masked positions a block in flight feeds per step; None: all (exact)
  position_budget: int | None = None  # d2f: positions a step may feed over the batch; None: no bound
  cache_decided: bool = False  # d2f: decided positions of blocks in flight are cached (approximate), not fed
  editing_threshold: float | None = None  # llada2: LLaDA2.1's token editing (T2T); None: off (LLaDA2.0)
  max_post_steps: int = 16  # llada2 with editing: forwards a block may run after its last mask
  block_cache: bool = False  # llada2: cache finished blocks' K/V, feed two blocks a step (speed option)
  # Compile the sampling path (temperature, top-p, top-k as knobs; a row at temperature 0 stays greedy); None:
  # whenever temperature > 0. A server sets it once for every request it may take.
  sample: bool | None = None

  def __post_init__(self):
    check(self)

  def replace(self, **changes) -> "DecodeConfig":
    return dataclasses.replace(self, **changes)

  def effective(self) -> "DecodeConfig":
    """The config the decoder really runs: 'threshold' is d2f with tau_add 1 and one block in flight."""
    if self.method == "threshold":
      return self.replace(tau_add=1.0, max_blocks_in_flight=1)
    return self

  def bucket(self, prompt_len: int) -> int:
    """Padded prompt length for a longest prompt of `prompt_len` tokens."""
    if isinstance(self.prompt_buckets, int):
      return -(-prompt_len // self.prompt_buckets) * self.prompt_buckets
    fitting = [b for b in sorted(self.prompt_buckets) if b >= prompt_len]
    if not fitting:
      raise ValueError(f"prompt of {prompt_len} tokens is longer than the largest prompt bucket "
                       f"{max(self.prompt_buckets)}")
    return fitting[0]


@dataclasses.dataclass(frozen=True)
class DecodeSpec:
  """The static (hashable) part of a decode: anything that changes shapes or code paths."""

  method: str
  model: ModelConfig
  block_size: int
  max_new_tokens: int
  max_blocks_in_flight: int  # resolved: no cap = the number of blocks
  window_widths: tuple[int, ...]  # sorted compiled window widths in blocks; the last is window_blocks
  sample: bool  # temperature > 0: sample with top-p instead of argmax
  steps: int
  alg: str
  query_mode: bool = False  # query_limit or position_budget set: the query-limited forward (q is a knob)
  position_budget: int | None = None  # see DecodeConfig
  query_widths: tuple[int, ...] = ()  # query mode: sorted compiled forward widths in positions
  cache_decided: bool = False  # query mode: decided positions in flight are cached, not fed (DecodeConfig)
  editing: bool = False  # llada2: LLaDA2.1's loop with token editing (DecodeConfig.editing_threshold)
  block_cache: bool = False  # llada2: finished blocks' K/V cached (DecodeConfig.block_cache)

  @property
  def num_blocks(self) -> int:
    return self.max_new_tokens // self.block_size

  @property
  def window_blocks(self) -> int:
    """Blocks in the widest d2f forward: those in flight plus the finished one awaiting its cache write,
    never more than the response has."""
    return min(self.max_blocks_in_flight + 1, self.num_blocks)

  @property
  def window(self) -> int:
    return self.window_blocks * self.block_size


@flax.struct.dataclass
class Knobs:
  """Traced decode parameters: changing them never recompiles.

  Each is one value for the whole batch (`resolve`), or one per row (a leading [B] axis: the serving
  engine, where every slot holds a request with its own settings); the decoders broadcast either way.
  """

  add_count: jax.Array  # int32: decoded tokens the last block needs before a new block is appended
  act_count: jax.Array  # int32: decoded tokens block i-1 needs before block i is fully activated
  tau_conf: jax.Array  # f32
  temperature: jax.Array  # f32; 0 = greedy (a row of a sampling batch may be greedy)
  top_p: jax.Array  # f32
  top_k: jax.Array  # int32; 0 = off
  stop_ids: jax.Array  # [MAX_STOP_IDS] int32, -1 = unused
  block_limit: jax.Array  # int32: response blocks a row may append (its max_new_tokens / block_size)
  in_flight_cap: jax.Array  # int32: blocks a row may decode at once (1 for 'threshold')
  query_limit: jax.Array  # int32: masks a block in flight feeds per step (query mode); the block size otherwise
  cache_decided: jax.Array  # bool: the row keeps its decided positions' K/V (a spec.cache_decided program)
  editing_threshold: jax.Array  # f32: llada2 editing rewrites a decided token above this (a spec.editing program)
  max_post_steps: jax.Array  # int32: llada2 editing: forwards a block may run after its last mask

  @classmethod
  def on_host(cls, config: DecodeConfig, model: ModelConfig) -> "Knobs":
    """`config`'s knobs for `model` as numpy scalars, checked once (SettingError names the field): what a
    server stacks into its slots' rows without a device round trip; `resolve` puts the same on the device."""
    run = config.effective()
    stop_ids = stop_ids_for(run, model)
    outside = [t for t in stop_ids if t >= model.vocab_size]
    if outside:
      raise SettingError("stop_ids", f"{outside} are outside the vocabulary [0, {model.vocab_size})")
    num_blocks = run.max_new_tokens // run.block_size
    return cls(add_count=np.int32(decoded_count_needed(run.tau_add, run.block_size)),
               act_count=np.int32(decoded_count_needed(run.tau_act, run.block_size)),
               tau_conf=np.float32(run.tau_conf), temperature=np.float32(run.temperature),
               top_p=np.float32(run.top_p), top_k=np.int32(run.top_k),
               stop_ids=np.asarray(list(stop_ids) + [-1] * (MAX_STOP_IDS - len(stop_ids)), np.int32),
               block_limit=np.int32(num_blocks), in_flight_cap=np.int32(in_flight_cap(run)),
               query_limit=np.int32(run.block_size if run.query_limit is None else run.query_limit),
               cache_decided=np.bool_(run.cache_decided),
               editing_threshold=np.float32(run.editing_threshold or 0.0), max_post_steps=np.int32(run.max_post_steps))


def per_row(x: jax.Array, ndim: int) -> jax.Array:
  """A scalar knob, or a per-row one [B], shaped to broadcast against an array of `ndim` dims whose first
  axis is the batch: [B] -> [B, 1, ...]."""
  x = jnp.asarray(x)
  return x if x.ndim == 0 else x.reshape(x.shape[:1] + (1,) * (ndim - 1) + x.shape[1:])


def decoded_count_needed(tau: float, block_size: int) -> int:
  """Smallest decoded count n with n / block_size >= tau, i.e. the ratio test done once in exact ints."""
  return next(n for n in range(block_size + 1) if n / block_size >= tau)


def in_flight_cap(run: DecodeConfig) -> int:
  """Blocks a row may decode at once: max_blocks_in_flight, or every block of the response (no cap)."""
  num_blocks = run.max_new_tokens // run.block_size
  return num_blocks if run.max_blocks_in_flight is None else min(run.max_blocks_in_flight, num_blocks)


def stop_ids_for(config: DecodeConfig, model: ModelConfig) -> tuple[int, ...]:
  if config.stop_ids is not None:
    return tuple(config.stop_ids)
  ids = [model.eos_token_id] + ([model.eot_token_id] if model.eot_token_id is not None else [])
  return tuple(dict.fromkeys(ids))


def resolve(config: DecodeConfig, model: ModelConfig) -> tuple[DecodeSpec, Knobs]:
  """Split a validated user config into the static spec and the traced knobs for `model`; a method that does
  not fit how the model attends (ModelConfig.attention_kind, when known) is refused here, so every caller of
  `generate` gets the check, not only the CLIs."""
  if model.attention_kind is not None:
    check_method_fits(model, config, model.attention_kind)
  run = config.effective()
  steps = run.steps if run.steps is not None else run.block_size if run.method == "llada2" else run.max_new_tokens
  cap = in_flight_cap(run)
  window_blocks = min(cap + 1, run.max_new_tokens // run.block_size)
  widths = window_widths_for(run.window_widths, window_blocks)
  query_mode = run.query_limit is not None or run.position_budget is not None or run.cache_decided
  spec = DecodeSpec(method="d2f" if run.method == "threshold" else run.method, model=model,
                    block_size=run.block_size, max_new_tokens=run.max_new_tokens, max_blocks_in_flight=cap,
                    window_widths=widths, sample=run.temperature > 0.0 if run.sample is None else run.sample,
                    steps=steps, alg=run.alg,
                    query_mode=query_mode, position_budget=run.position_budget,
                    query_widths=query_widths_for(run.block_size, widths) if query_mode else (),
                    cache_decided=run.cache_decided, editing=run.editing_threshold is not None,
                    block_cache=run.block_cache)
  return spec, jax.tree.map(jnp.asarray, Knobs.on_host(config, model))
