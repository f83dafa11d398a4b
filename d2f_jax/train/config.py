"""The trainer config: defaults, hardware presets, `arg` parsing and validation.

`objective` picks what the one Trainer optimises: 'distill' (D2F asymmetric distillation, the default),
'mdm' (LLaDA's masked-diffusion loss: pre-training / SFT of a bidirectional base) or 'ar' (next-token
prediction: the causal baseline of the same size).

Config files under configs/ are big_vision style: `get_config(arg=None)` builds on `base_config()` and
reads a small `arg` string ("tpu_v5p_64", "family=dream,full") through `parse_arg`. `validate` checks every
field the trainer reads and names the bad one, so a typo fails before any device work.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os

import ml_collections
from ml_collections import config_dict

from d2f_jax.models.config import EXPERT_DISPATCHES
from d2f_jax.sharding.rules import DEFAULT_RULES, MESH_AXES  # the one home of the mesh axes and rules

MODEL_INITS = ("path", "random")

# name -> (mesh sizes, global batch, micro batches). Global batch = sequences per optimizer step.
HARDWARE = {
    "gpu_8xa100": (dict(data=1, fsdp=8, tensor=1), 16, 2),  # 1 sequence per GPU per microbatch (40 GB)
    "gpu_8xh100": (dict(data=1, fsdp=8, tensor=1), 32, 2),
    "gpu_2x8xh100": (dict(data=2, fsdp=8, tensor=1), 64, 2),  # two hosts: data across, FSDP inside a node
    "tpu_v5p_64": (dict(data=4, fsdp=8, tensor=1), 64, 1),  # 32 chips, 95 GB each
    # 64 chips, 16 GB each: weights need wide FSDP; 128 rows in 2 microbatches keep one row per chip per slice.
    "tpu_v5e_64": (dict(data=4, fsdp=16, tensor=1), 128, 2),
    "cpu": (dict(data=1, fsdp=-1, tensor=1), 8, 1),
}


def base_config() -> ml_collections.ConfigDict:
  """Defaults shared by every model: the paper's distillation recipe with LoRA on q, k, v, o."""
  c = ml_collections.ConfigDict()
  c.objective = "distill"  # a key of d2f_jax.train.objectives.OBJECTIVES: distill, mdm or ar
  c.seed = 0
  c.total_steps = 10_000
  c.batch_size = 32  # global sequences per optimizer step
  c.micro_batches = 1  # gradient accumulation: the batch is scanned in this many slices
  c.block_size = 16

  c.model = ml_collections.ConfigDict()
  c.model.init = "path"  # 'path': weights from model.path (or model.synthetic); 'random': fresh, from the config
  c.model.path = config_dict.placeholder(str)  # HF or converted directory of the base (teacher) model
  c.model.preset = config_dict.placeholder(str)  # or a preset name, randomly initialised (tests, benchmarks)
  c.model.overrides = ml_collections.ConfigDict()  # ModelConfig fields over the preset (all of them if no preset)
  c.model.synthetic = False  # write a random HF checkpoint + tokenizer of `preset` into the workdir and use it
  c.model.dtype = "bfloat16"  # storage and compute dtype of the base weights
  # MoEConfig.dispatch of a mixture-of-experts base (ragged, dense, auto; models/moe.py); None: the model's
  c.model.expert_dispatch = config_dict.placeholder(str)
  c.remat = False  # recompute each layer in the backward pass (ModelConfig.remat): activations O(1) in depth

  c.finetune = "lora"  # 'lora' (student = base + adapter) or 'full' (student = trainable copy of the base)
  c.lora = ml_collections.ConfigDict(dict(rank=32, alpha=32.0, dropout=0.1, targets=("q", "k", "v", "o"),
                                          use_rslora=False))
  c.train_dtype = "float32"  # dtype of the trainable parameters and their optimizer state

  c.schedule = ml_collections.ConfigDict(dict(kind="monotone", low=0.2, high=0.7))  # distill only
  # mdm only: mask ratio t ~ U(eps, 1) per row; semi_ar: fraction of rows noised as a semi-AR decode's states
  # (clean before a cut, `window` positions masked with probability t, all masked after; loss_mdm.py);
  # suffix_weight: the loss weight's factor on that all-masked suffix (0: the window's loss alone);
  # ar_weight: adds this times the causal next-token CE of the clean rows (a second pass; Dream layout only)
  c.mdm = ml_collections.ConfigDict(dict(eps=1e-3, semi_ar=0.0, window=32, suffix_weight=1.0, ar_weight=0.0))
  c.loss_chunk = 0  # sequence rows per logits chunk (0: whole sequence); bounds the [B, T, V] fp32 buffers

  c.data = ml_collections.ConfigDict()
  c.data.source = "jsonl"  # jsonl, npz, tfds or hf_datasets (train/data.py, train/data_sources.py)
  c.data.path = config_dict.placeholder(str)
  c.data.eval_path = config_dict.placeholder(str)  # default: hold out the last `eval_examples` of `path`
  c.data.eval_examples = 256
  c.data.question_field = "question"
  c.data.answer_field = "answer"
  c.data.tokenizer = config_dict.placeholder(str)  # default: the tokenizer in model.path; copied into exports
  c.data.seq_len = 1024
  # Length-bucketed batches (train/buckets.py): e.g. (256, 512) cuts each batch to 256, 512 or seq_len, the
  # shortest its rows fit in (one compiled step per length). () : every batch is seq_len long.
  c.data.length_buckets = ()
  c.data.synthetic_examples = 512  # size of the JSONL written when model.synthetic and no data.path
  c.data.prefetch = 2

  c.optim = ml_collections.ConfigDict(dict(lr=1e-5, warmup_steps=0, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.05,
                                           clip=1.0, decay="constant"))

  c.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=-1, tensor=1))
  c.logical_axis_rules = DEFAULT_RULES
  c.distributed = "auto"  # 'auto' (from the environment), 'on', 'off'

  c.checkpoint = ml_collections.ConfigDict(dict(every=500, keep=3, async_save=True))
  c.log_every = 10
  c.eval_every = 500
  c.eval_batches = 8
  c.export = True  # at the end: <workdir>/adapter (PEFT, LoRA runs) or <workdir>/hf (HF checkpoint: full runs, LLaDA2)
  c.peak_flops = config_dict.placeholder(float)  # per device; default from the device kind (CPU: measured)
  c.progress_bar = True
  return c


def parse_arg(arg: str | None, *, positional: str | None = None, **defaults) -> ml_collections.ConfigDict:
  """big_vision-style `arg`: comma-separated `key=value` (typed like the default) or bare words.

  A bare word sets a boolean default to True; any other bare word fills `positional`,
  e.g. parse_arg("tpu_v5p_64,runlocal", positional="hw", hw="gpu_8xa100", runlocal=False).
  """
  out = ml_collections.ConfigDict(defaults)
  for token in filter(None, (t.strip() for t in (arg or "").split(","))):
    key, eq, value = token.partition("=")
    if not eq:
      if isinstance(defaults.get(key), bool):
        out[key] = True
        continue
      if positional is None:
        raise ValueError(f"config arg {token!r} is not a known switch; known: {sorted(defaults)}")
      key, value = positional, token
    if key not in defaults:
      raise ValueError(f"unknown config arg {key!r}; known: {sorted(defaults)}")
    kind = type(defaults[key])
    if kind is bool:
      if value.lower() not in ("true", "false", "1", "0"):
        raise ValueError(f"config arg {key}={value!r} must be true or false")
      out[key] = value.lower() in ("true", "1")
    else:
      out[key] = kind(value) if defaults[key] is not None else value
  return out


def load_config_file(path_and_arg: str) -> ml_collections.ConfigDict:
  """`get_config(arg)` of a config file given as 'path.py' or 'path.py:arg' (what --config takes)."""
  path, _, arg = path_and_arg.partition(":")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"config file {path!r} does not exist")
  spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg or None)


def apply_hardware(config: ml_collections.ConfigDict, name: str) -> None:
  """Set mesh, global batch and micro batches from a HARDWARE preset."""
  if name not in HARDWARE:
    raise ValueError(f"unknown hardware preset {name!r}; known: {sorted(HARDWARE)}")
  mesh, batch, micro = HARDWARE[name]
  config.mesh.update(mesh)
  config.batch_size, config.micro_batches = batch, micro


def _require(ok: bool, field: str, value, why: str) -> None:
  if not ok:
    raise ValueError(f"config.{field}={value!r}: {why}")


def validate(c: ml_collections.ConfigDict) -> None:
  """Raise ValueError naming the first bad field."""
  from d2f_jax.train.objectives import OBJECTIVES  # the one table of objectives
  objective = c.get("objective", "distill")
  _require(objective in OBJECTIVES, "objective", objective, f"must be one of {tuple(OBJECTIVES)}")
  _require(c.total_steps > 0, "total_steps", c.total_steps, "must be positive")
  _require(c.batch_size > 0, "batch_size", c.batch_size, "must be positive")
  _require(c.micro_batches > 0 and c.batch_size % c.micro_batches == 0, "micro_batches", c.micro_batches,
           f"must be positive and divide batch_size={c.batch_size}")
  _require(c.block_size > 0, "block_size", c.block_size, "must be positive")
  _require(c.data.seq_len > c.block_size, "data.seq_len", c.data.seq_len, f"must exceed block_size={c.block_size}")
  _validate_model(c, objective)
  _require(c.finetune in ("lora", "full"), "finetune", c.finetune, "must be 'lora' or 'full'")
  _require(c.schedule.kind in ("monotone", "random"), "schedule.kind", c.schedule.kind,
           "must be 'monotone' (reference) or 'random' (ablation)")
  _require(0.0 < c.schedule.low <= c.schedule.high <= 1.0, "schedule.low", (c.schedule.low, c.schedule.high),
           "need 0 < low <= high <= 1")
  eps = c.get("mdm", {}).get("eps", 1e-3)
  _require(0.0 < eps < 1.0, "mdm.eps", eps, "must lie in (0, 1)")
  semi_ar, window = c.get("mdm", {}).get("semi_ar", 0.0), c.get("mdm", {}).get("window", 32)
  _require(0.0 <= semi_ar <= 1.0, "mdm.semi_ar", semi_ar, "must lie in [0, 1]")
  _require(isinstance(window, int) and window >= 1, "mdm.window", window, "must be an int >= 1")
  suffix_weight = c.get("mdm", {}).get("suffix_weight", 1.0)
  _require(0.0 <= suffix_weight <= 1.0, "mdm.suffix_weight", suffix_weight, "must lie in [0, 1]")
  ar_weight = c.get("mdm", {}).get("ar_weight", 0.0)
  _require(isinstance(ar_weight, (int, float)) and ar_weight >= 0.0, "mdm.ar_weight", ar_weight, "must be >= 0")
  _require(ar_weight == 0.0 or objective == "mdm", "mdm.ar_weight", ar_weight,
           f"mixes the AR loss into objective 'mdm' only (objective is {objective!r})")
  _require(c.loss_chunk >= 0 and (c.loss_chunk == 0 or c.data.seq_len % c.loss_chunk == 0), "loss_chunk",
           c.loss_chunk, f"must be 0 or divide data.seq_len={c.data.seq_len}")
  length_buckets = c.data.get("length_buckets", ())
  _require(isinstance(length_buckets, (tuple, list)) and all(
      isinstance(b, int) and c.block_size < b <= c.data.seq_len for b in length_buckets), "data.length_buckets",
      length_buckets, f"must be ints in (block_size={c.block_size}, data.seq_len={c.data.seq_len}]")
  _require(c.loss_chunk == 0 or all(b % c.loss_chunk == 0 for b in length_buckets), "data.length_buckets",
           length_buckets, f"each must be a multiple of loss_chunk={c.loss_chunk}")
  _require(c.data.path is not None or c.model.synthetic, "data.path", None,
           "a question/answer file is required (or model.synthetic=True for generated data)")
  _require(c.data.eval_examples >= 0, "data.eval_examples", c.data.eval_examples, "must be >= 0")
  for axis in MESH_AXES:
    size = c.mesh.get(axis)
    _require(isinstance(size, int) and (size > 0 or size == -1), f"mesh.{axis}", size, "must be a positive int or -1")
  _require(sum(c.mesh[a] == -1 for a in MESH_AXES) <= 1, "mesh", dict(c.mesh), "at most one axis may be -1")
  extra = sorted(set(c.mesh) - set(MESH_AXES))
  _require(not extra, "mesh", dict(c.mesh), f"unknown axes {extra}; axes are {MESH_AXES}")
  _require(c.distributed in ("auto", "on", "off"), "distributed", c.distributed, "must be 'auto', 'on' or 'off'")
  _require(c.checkpoint.every > 0 and c.checkpoint.keep > 0, "checkpoint.every", c.checkpoint.every,
           "checkpoint.every and checkpoint.keep must be positive")
  _require(c.log_every > 0 and c.eval_every > 0, "log_every", c.log_every, "log_every and eval_every must be positive")
  for field in ("lr", "eps", "clip"):
    value = c.optim[field]
    _require(isinstance(value, (int, float)) and math.isfinite(value) and value > 0, f"optim.{field}", value,
             "must be a finite positive number")
  for field in ("b1", "b2", "weight_decay"):
    value = c.optim[field]
    _require(isinstance(value, (int, float)) and math.isfinite(value), f"optim.{field}", value,
             "must be a finite number")
  _require(c.optim.decay in ("constant", "cosine", "linear"), "optim.decay", c.optim.decay,
           "must be 'constant' (the reference), 'cosine' or 'linear'")
  _require(c.optim.decay == "constant" or c.total_steps > c.optim.warmup_steps, "optim.decay", c.optim.decay,
           f"a decaying schedule needs total_steps ({c.total_steps}) > optim.warmup_steps ({c.optim.warmup_steps})")
  _require(c.optim.warmup_steps >= 0 and c.optim.weight_decay >= 0, "optim.warmup_steps", c.optim.warmup_steps,
           "warmup_steps and weight_decay must be >= 0")


def _validate_model(c: ml_collections.ConfigDict, objective: str) -> None:
  """Where the weights come from, and whether the objective can train them that way."""
  m = c.model
  init = m.get("init", "path")
  _require(init in MODEL_INITS, "model.init", init, f"must be one of {MODEL_INITS}")
  dispatch = m.get("expert_dispatch")
  _require(dispatch is None or dispatch in EXPERT_DISPATCHES, "model.expert_dispatch", dispatch,
           f"must be one of {EXPERT_DISPATCHES} (or unset: the model's)")
  if init == "random":
    _require(m.path is None, "model.path", m.path, "model.init='random' builds fresh weights; unset model.path "
             "or use model.init='path'")
    _require(m.preset is not None or bool(m.get("overrides")), "model.preset", m.preset,
             "model.init='random' needs model.preset and/or model.overrides (every ModelConfig shape field)")
    _require(c.finetune == "full", "finetune", c.finetune,
             "LoRA needs a base to adapt; use finetune='full' with model.init='random'")
  else:
    _require(m.path is not None or m.preset is not None, "model.path", m.path,
             "set model.path (HF or converted directory) or model.preset (random init)")
  _require(not (m.path and m.synthetic), "model.synthetic", m.synthetic,
           "a synthetic checkpoint replaces model.path; set only one")
  if c.data.source != "npz" and m.path is None and not m.synthetic:
    _require(c.data.tokenizer is not None, "data.tokenizer", None,
             f"data.source={c.data.source!r} tokenizes text but there is no model.path to take a tokenizer from")


# Fields a resumed run must share with the run that wrote the checkpoints: they fix the shapes of the
# trained state (LoRA rank and targets, full vs LoRA, the model's shape, the trainable dtype) or what the
# trained parameters mean (objective, LoRA scale). Everything else (lr, steps, logging, eval) may change.
RESUME_FIELDS = ("objective", "finetune", "lora.rank", "lora.targets", "lora.alpha", "lora.use_rslora",
                 "train_dtype", "model.init", "model.preset", "model.overrides", "model.synthetic")


def _lookup(tree: dict, dotted: str):
  node = tree
  for part in dotted.split("."):
    if not isinstance(node, dict) or part not in node:
      return "<unset>"
    node = node[part]
  return node


def resume_mismatches(saved: dict, config: ml_collections.ConfigDict) -> list[str]:
  """'field: checkpoint A, config B' for each RESUME_FIELDS entry where the saved run config differs."""
  now = json.loads(config.to_json_best_effort())
  out = []
  for field in RESUME_FIELDS:
    before, after = _lookup(saved, field), _lookup(now, field)
    if field.startswith("lora.") and _lookup(now, "finetune") != "lora":
      continue  # full fine-tuning ignores the LoRA fields
    if before != after:
      out.append(f"{field}: checkpoint {before!r}, config {after!r}")
  return out


def check_resume(workdir: str, config: ml_collections.ConfigDict, newest_step: int | None) -> None:
  """Refuse to resume checkpoints of `workdir` written by an incompatible config, before anything in the
  workdir is overwritten; the saved config is `<workdir>/config.json`, written when the run started."""
  path = os.path.join(workdir, "config.json")
  if newest_step is None or not os.path.isfile(path):
    return
  try:
    with open(path) as f:
      saved = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise ValueError(f"{path}: the config of the checkpointed run cannot be read ({e}); fix or remove it") from e
  diffs = resume_mismatches(saved, config)
  if diffs:
    raise ValueError(f"{workdir} holds checkpoints (newest step {newest_step}) of a run with another config: "
                     + "; ".join(diffs) + f" (saved in {path}). Use a new --workdir, or set these fields back")
