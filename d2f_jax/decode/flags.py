"""The flags every decoding command line shares (generate, evaluate): the model to load, the DecodeConfig
they build, and where the decode runs (--attention, --mesh, --distributed)."""

from __future__ import annotations

import argparse
import os

from d2f_jax import compilation_cache
from d2f_jax.decode.config import DecodeConfig
from d2f_jax.decode.config_checks import DREAM_ALGS
from d2f_jax.decode.methods import METHODS
from d2f_jax.models.config import EXPERT_DISPATCHES, LAYER_LOOPS
from d2f_jax.usage import UsageError

_DEFAULTS = DecodeConfig()


def add_model_flags(parser) -> None:
  """Add --model, --lora_dir (the name convert uses; --lora is a hidden alias) and --dtype."""
  parser.add_argument("--model", required=True, help="HF or converted model directory, or a Hub id in the local cache")
  parser.add_argument("--lora_dir", default=None, help="PEFT adapter directory merged into the model (a D2F student)")
  parser.add_argument("--lora", dest="lora_dir", help=argparse.SUPPRESS)
  parser.add_argument("--dtype", default=None,
                      help="compute / storage dtype, e.g. bfloat16 or float32 (default: the checkpoint's)")


def check_model_flags(args: argparse.Namespace) -> None:
  """Read --model's config.json / d2f_model.json and find --lora_dir before anything slow: a path that is
  not there or holds no readable model is a UsageError naming it. (A Hub id is left to the loader.)"""
  from d2f_jax.convert import read_model_config, resolve_model_dir
  from d2f_jax.convert.errors import ConvertError
  from d2f_jax.convert.source import HUB_ID
  if os.path.exists(args.model) or not HUB_ID.match(args.model) or args.model.startswith((".", "~")):
    try:
      read_model_config(resolve_model_dir(args.model, what="--model"))
    except (ConvertError, OSError) as e:  # names --model or the file
      raise UsageError(str(e)) from None
  if args.lora_dir is not None and not os.path.isfile(os.path.join(args.lora_dir, "adapter_config.json")):
    raise UsageError(f"--lora_dir {args.lora_dir!r} is not a PEFT adapter directory (no adapter_config.json)")


def add_decode_flags(parser) -> None:
  """Add --method, --block_size, thresholds, sampling, steps, alg, llada2's editing, --prompt_bucket and
  --stop_ids."""
  parser.add_argument("--method", default=_DEFAULTS.method, choices=METHODS,
                      help="d2f: pipelined blocks with a KV cache; threshold: one block in flight; vanilla: LLaDA "
                           "low-confidence remasking; dream_vanilla: Dream's ordering by --alg; ar: causal decoding")
  parser.add_argument("--block_size", type=int, default=_DEFAULTS.block_size,
                      help="tokens per block; --max_new_tokens must be a multiple of it")
  parser.add_argument("--max_new_tokens", type=int, default=_DEFAULTS.max_new_tokens, help="tokens to generate")
  parser.add_argument("--max_blocks_in_flight", type=int, default=_DEFAULTS.max_blocks_in_flight,
                      help="d2f: cap on the blocks decoding at once (None: no cap, the paper's loop)")
  parser.add_argument("--tau_add", type=float, default=_DEFAULTS.tau_add,
                      help="d2f: add the next block once the newest is this fraction decoded")
  parser.add_argument("--tau_act", type=float, default=_DEFAULTS.tau_act,
                      help="d2f: a new block becomes fully active once its predecessor is this fraction decoded")
  parser.add_argument("--tau_conf", type=float, default=_DEFAULTS.tau_conf,
                      help="d2f / threshold: unmask the tokens whose confidence exceeds this")
  parser.add_argument("--temperature", type=float, default=_DEFAULTS.temperature, help="0: greedy")
  parser.add_argument("--top_p", type=float, default=_DEFAULTS.top_p, help="nucleus sampling mass (1: off)")
  parser.add_argument("--top_k", type=int, default=_DEFAULTS.top_k, help="sample among the k most probable (0: off)")
  parser.add_argument("--steps", type=int, default=None,
                      help="vanilla / dream_vanilla steps, llada2 steps per block (default: one per token)")
  parser.add_argument("--alg", default=_DEFAULTS.alg, choices=DREAM_ALGS, help="dream_vanilla: which tokens go first")
  add_llada2_flags(parser)
  parser.add_argument("--prompt_bucket", type=int, default=_DEFAULTS.prompt_buckets,
                      help="pad prompt lengths to a multiple of this (fewer compiles, more padding)")
  parser.add_argument("--memory_budget_gib", type=float, default=None,
                      help="KV cache + weights must fit this many GiB (default: the decoding devices' memory)")
  parser.add_argument("--stop_ids", default=None,
                      help="comma-separated stop ids; 'none' never stops early (default: eos and end-of-turn)")
  add_mode_flags(parser)


def add_llada2_flags(parser) -> None:
  """Add method llada2's settings: LLaDA2.1's token editing (--editing_threshold, --max_post_steps) and
  --block_cache (generate, evaluate and serve)."""
  parser.add_argument("--editing_threshold", type=float, default=_DEFAULTS.editing_threshold,
                      help="llada2: LLaDA2.1's token editing, rewrite a decided token above this (quality mode "
                           "0.5 with --tau_conf 0.7, speed mode 0.0 with 0.5; default: off, LLaDA2.0's sampler)")
  parser.add_argument("--max_post_steps", type=int, default=_DEFAULTS.max_post_steps,
                      help="llada2 with editing: forwards a block may run after its last mask")
  parser.add_argument("--block_cache", action="store_true", default=_DEFAULTS.block_cache,
                      help="llada2: cache finished blocks' K/V and feed two blocks a step instead of the whole "
                           "sequence (greedy tokens equal but for float near-ties; default: the released loop)")


def add_mode_flags(parser) -> None:
  """Add the d2f throughput modes, --query_limit, --position_budget and --cache_decided (generate, evaluate and
  serve)."""
  parser.add_argument("--query_limit", type=int, default=_DEFAULTS.query_limit,
                      help="d2f throughput mode: a block in flight feeds only its first N masks a step (fewer "
                           "positions, other tokens; default: off, the authors' loop)")
  parser.add_argument("--position_budget", type=int, default=_DEFAULTS.position_budget,
                      help="d2f throughput mode under load: positions a step may feed over the live rows (a "
                           "server's slots); beyond it every row's window narrows (tokens then depend on what "
                           "shares the batch; default: off)")
  parser.add_argument("--cache_decided", action="store_true", default=_DEFAULTS.cache_decided,
                      help="d2f throughput mode: decided positions of blocks in flight keep their (approximate) "
                           "K/V in the cache instead of being fed every step; exact again when a block completes")


def decode_config_from_flags(args: argparse.Namespace) -> DecodeConfig:
  """The DecodeConfig of parsed flags; a bad value exits with the option and what was expected."""
  stop_ids = None
  if args.stop_ids is not None:
    text = args.stop_ids.strip().lower()
    try:
      stop_ids = () if text == "none" else tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError as e:
      raise UsageError(f"--stop_ids must be comma-separated ints or 'none', got {args.stop_ids!r}") from e
  try:
    return DecodeConfig(method=args.method, block_size=args.block_size, max_new_tokens=args.max_new_tokens,
                        max_blocks_in_flight=args.max_blocks_in_flight, tau_add=args.tau_add, tau_act=args.tau_act,
                        tau_conf=args.tau_conf, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                        steps=args.steps, alg=args.alg, stop_ids=stop_ids, prompt_buckets=args.prompt_bucket,
                        memory_budget_gib=args.memory_budget_gib, query_limit=args.query_limit,
                        position_budget=args.position_budget, cache_decided=args.cache_decided,
                        editing_threshold=args.editing_threshold, max_post_steps=args.max_post_steps,
                        block_cache=args.block_cache)
  except ValueError as e:
    raise UsageError(f"bad decoding option: {e}") from e


ATTENTION_CHOICES = ("auto", "xla", "pallas")
DISTRIBUTED_CHOICES = ("auto", "on", "off")


def add_device_flags(parser) -> None:
  """Add --attention, --layer_loop, --expert_dispatch, --mesh, --distributed (where and how the decode runs)
  and --compilation_cache."""
  parser.add_argument("--attention", default="auto", choices=ATTENTION_CHOICES,
                      help="attention implementation: Pallas kernels on GPU/TPU with 'auto' (the XLA reference on "
                           "CPU), 'xla' everywhere, 'pallas' always")
  parser.add_argument("--layer_loop", default=None, choices=LAYER_LOOPS,
                      help="how cached forwards run the layers: 'auto' unrolls them (weights and cache read in place; "
                           "long compiles on TPU), 'scan' (compiles in seconds; on TPU copies q's and k's weight "
                           "slices, docs/pods.md: compile times) (default: the model's, 'auto')")
  parser.add_argument("--expert_dispatch", default=None, choices=EXPERT_DISPATCHES,
                      help="how a mixture-of-experts model (LLaDA2) computes its experts: 'ragged' (grouped matmul, "
                           "the default), 'dense' (every expert on every token, no sort; fewer temporaries on GPU), "
                           "'auto' (per forward by token count; a token's float32 sums then depend on its batch) "
                           "(docs/models.md)")
  parser.add_argument("--mesh", default=None,
                      help="decode on a device mesh, e.g. data=2,tensor=4 (axes data, fsdp, tensor; unnamed axes 1, "
                           "one may be -1 = the remaining devices); weights split by training's logical rules")
  parser.add_argument("--distributed", default="auto", choices=DISTRIBUTED_CHOICES,
                      help="jax.distributed.initialize(): 'auto' when the environment shows a multi-process launch")
  parser.add_argument("--compilation_cache", default="auto", help=compilation_cache.CHOICES_HELP)


def setup_devices(args: argparse.Namespace, *, local: bool = False):
  """Start jax.distributed as --distributed says, turn on the --compilation_cache, then build the --mesh
  (None without one). `local`: the
  mesh spans this process's devices only (evaluation splits problems across processes instead).
  Call before any other JAX work. A bad flag exits naming it."""
  from d2f_jax import sharding

  try:
    sizes = sharding.parse_mesh(args.mesh) if args.mesh else None
  except ValueError as e:
    raise UsageError(str(e)) from e
  try:
    sharding.maybe_initialize_distributed(args.distributed)
  except RuntimeError as e:
    raise UsageError(f"--distributed {args.distributed}: jax.distributed.initialize() failed: {e}") from e
  try:
    compilation_cache.enable(args.compilation_cache)
  except ValueError as e:
    raise UsageError(str(e)) from e
  if sizes is None:
    return None
  import jax
  devices = jax.local_devices() if local else jax.devices()
  try:
    return sharding.make_mesh(sizes, devices)
  except ValueError as e:
    raise UsageError(f"--mesh {args.mesh}: {e}") from e
