"""The stages of the miniature reproduction, each resumable: data, AR pre-training, MDM adaptation, D2F
distillation (optionally a LLaDA-layout teacher from scratch), evaluation, report.

The recipe is Dream-7B's plus D2F, in miniature: a Dream-layout model is pre-trained autoregressively (it is
also the AR baseline), adapted to masked diffusion with shifted logits (the teacher), then distilled into the
block-causal D2F student. Every training stage is the project's one Trainer with a different objective
(ar, mdm, distill) and writes a Hugging Face-format export (workdir/<stage>/hf); a finished stage is skipped
when the run is restarted, an unfinished one resumes from its newest checkpoint.
"""

from __future__ import annotations

import json
import os
import sys
import time

import ml_collections

import d2f_jax
from d2f_jax import workdir_lock
from d2f_jax.convert.hf_config import ATTENTION_KEY
from d2f_jax.e2e import data as data_lib
from d2f_jax.e2e import ceiling, evaluation, report
from d2f_jax.reporting import write_json
from d2f_jax.tasks import tokenizer as tokenizer_lib
from d2f_jax.tasks.arithmetic import STYLES, ArithmeticTask
from d2f_jax.train import config as train_config
from d2f_jax.train.trainer import Trainer

# What each exported model is, for `d2f_jax.decode.methods.check_method_fits` (config.json ATTENTION_KEY).
STAGE_ATTENTION = {"ar": "causal", "teacher": "bidirectional", "student": "block_causal",
                   "llada_teacher": "bidirectional"}


def say(message: str) -> None:
  """A stage message on stderr, visible whatever the logging set-up."""
  print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def model_overrides(c: ml_collections.ConfigDict, family: str) -> dict:
  """ModelConfig fields of a tiny model of `family` ('dream': q/k/v bias and shifted logits; 'llada': neither),
  special ids from the task's tokenizer."""
  if family not in ("dream", "llada"):
    raise ValueError(f"family must be 'dream' or 'llada', got {family!r}")
  dream = family == "dream"
  return dict(vocab_size=len(tokenizer_lib.vocabulary()), family=family, qkv_bias=dream, logit_shift=dream,
              tie_embeddings=False, dtype="float32", param_dtype="float32", **c.model.to_dict(),
              **tokenizer_lib.special_ids())


def stage_config(c, *, objective: str, data_path: str, tokenizer_dir: str, steps: int, lr: float, warmup: int,
                 model_path: str | None = None, family: str = "dream", finetune: str = "full", lora_rank: int = 32,
                 decay: str = "constant", semi_ar: float = 0.0, suffix_weight: float = 1.0, ar_weight: float = 0.0):
  """A Trainer config for one stage on the pre-tokenized task data: random init of `family` without a
  `model_path`, else initialised from that stage's export (same layout, any objective)."""
  t = train_config.base_config()
  t.objective = objective
  t.seed = c.seed
  t.total_steps = steps
  t.batch_size = c.batch_size
  t.block_size = c.block_size
  if model_path is None:
    t.model.init = "random"
    t.model.overrides = ml_collections.ConfigDict(model_overrides(c, family))
  else:
    t.model.path = model_path
  t.model.dtype = "float32"
  t.finetune = finetune
  t.lora.update(dict(rank=lora_rank, alpha=float(lora_rank), dropout=0.0))
  t.data.update(dict(source="npz", path=data_path, tokenizer=tokenizer_dir, seq_len=c.seq_len,
                     eval_examples=4 * c.batch_size, length_buckets=tuple(c.get("length_buckets", ()))))
  t.optim.lr = lr
  t.optim.warmup_steps = warmup
  t.optim.decay = decay
  if semi_ar:  # mdm rows noised as a semi-AR decode's states, over the decode block (train/loss_mdm.py)
    t.mdm.update(dict(semi_ar=semi_ar, window=evaluation.decode_block_size(c), suffix_weight=suffix_weight))
  t.mdm.ar_weight = ar_weight  # mdm: plus this times the causal next-token loss of the clean rows
  t.optim.weight_decay = 0.0 if model_path is None else t.optim.weight_decay
  t.mesh.update(dict(data=1, fsdp=-1, tensor=1))
  t.checkpoint.update(dict(every=max(steps // 4, 1), keep=1))
  t.log_every, t.eval_every, t.eval_batches = max(steps // 20, 1), max(steps // 4, 1), 2
  train_config.validate(t)
  return t


def mark_attention(export_dir: str, kind: str) -> None:
  """Record in the export's config.json how the model was trained to attend (an extra key transformers
  ignores), so a decoding method that does not fit it is refused. A stage initialised from another
  inherits its config.json, hence the rewrite."""
  path = os.path.join(export_dir, "config.json")
  with open(path) as f:
    hf = json.load(f)
  if hf.get(ATTENTION_KEY) != kind:
    hf[ATTENTION_KEY] = kind
    write_json(path, hf)


class StageConfigChanged(ValueError):
  """A finished stage whose recorded config differs from the requested one; names the differing fields."""


class ConfigError(ValueError):
  """A main-job config that cannot run, caught before any stage trains (not 40 minutes into the run)."""


class StagePreempted(RuntimeError):
  """A stage stopped early by SIGTERM / a preemption notice; its checkpoint is saved and a re-run resumes it."""


def check_config(c) -> None:
  """Refuse, naming the field, what would only fail at evaluation: the decode block and max_new_tokens."""
  block = evaluation.decode_block_size(c)
  if not isinstance(block, int) or isinstance(block, bool) or block <= 0 or c.max_new_tokens % block:
    raise ConfigError(f"config.max_new_tokens ({c.max_new_tokens}) must be a multiple of the decode block "
                      f"({block!r}: config.decode_block_size, or config.block_size when that is None), which must "
                      "be a positive int")
  style = c.task.get("style", "terse")
  if style not in STYLES:
    raise ConfigError(f"config.task.style must be one of {STYLES}, got {style!r}")


def data_identity(c) -> dict:
  """The training data's fields; task.style is left out at its default, so older finished stages are reused."""
  task = {k: v for k, v in c.task.to_dict().items() if not (k == "style" and v == "terse")}
  return {"seed": c.seed, "task": task, "seq_len": c.seq_len}


PATH_FIELDS = ("model.path", "data.path", "data.tokenizer")  # where things are, not what was trained
# Trainer fields added after stages were first recorded: left out at these defaults, so older finished stages
# (which trained as the defaults do) are reused.
LATER_FIELDS = {"mdm.semi_ar": 0.0, "mdm.window": 32, "mdm.suffix_weight": 1.0, "mdm.ar_weight": 0.0,
                "model.expert_dispatch": None, "data.length_buckets": []}


def stage_identity(config, upstream: dict | None = None, data: dict | None = None) -> dict:
  """What a stage's result depends on, flat: its Trainer config (paths left out: they follow the workdir),
  the fields the training data was generated from, and its initialising stage's identity (`init.*`)."""
  fields = {k: v for k, v in _flat(config.to_dict()).items()
            if k not in PATH_FIELDS and not (k in LATER_FIELDS and v == LATER_FIELDS[k])}
  fields.update({f"data_source.{k}": v for k, v in _flat(data or {}).items()})
  fields.update({f"init.{k}": v for k, v in (upstream or {}).items()})
  return json.loads(json.dumps(fields, default=str))  # as it reads back from stage_done.json


def _flat(tree: dict, prefix: str = "") -> dict:
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      out.update(_flat(value, f"{prefix}{key}."))
    else:
      out[prefix + key] = list(value) if isinstance(value, tuple) else value
  return out


def _differences(done: dict, identity: dict, config) -> list[str]:
  """'field: finished X, requested Y' for each field the finished stage differs in. A marker from before
  configs were recorded holds only the objective and the steps: those are compared."""
  saved = done.get("config")
  if not isinstance(saved, dict):
    saved = {"objective": done.get("objective"), "total_steps": done.get("steps")}
    identity = {"objective": config.objective, "total_steps": config.total_steps}
  absent = "absent"
  return [f"{k}: finished {saved.get(k, absent)}, requested {identity.get(k, absent)}"
          for k in sorted(set(saved) | set(identity)) if k not in saved or k not in identity or saved[k] != identity[k]]


def train_stage(name: str, config, workdir: str, identity: dict | None = None, rerun: bool = False
                ) -> tuple[str, dict]:
  """Run (or resume, or reuse) one training stage; returns (export dir, summary).

  A finished stage is reused only when its recorded identity (stage_identity) equals the requested one;
  otherwise StageConfigChanged names the differing fields: reusing it wrote a config into results.json that
  did not run. `rerun`: move the stage's directory aside (`<stage>.old-<time>`, never deleted) and train it
  afresh."""
  identity = identity if identity is not None else stage_identity(config)
  stage_dir = os.path.join(workdir, name)
  done_marker = os.path.join(stage_dir, "stage_done.json")
  export_dir = os.path.join(stage_dir, "adapter" if config.finetune == "lora" else "hf")
  if rerun and os.path.exists(stage_dir):
    aside = f"{stage_dir}.old-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    os.rename(stage_dir, aside)
    say(f"stage {name}: rerun requested; moved its previous directory to {aside}")
  elif os.path.exists(done_marker):
    with open(done_marker) as f:
      done = json.load(f)
    diffs = _differences(done, identity, config)
    if diffs:
      raise StageConfigChanged(
          f"stage {name} in {workdir} finished with another config ({done_marker}): " + "; ".join(diffs[:8])
          + (f" (and {len(diffs) - 8} more)" if len(diffs) > 8 else "") + f". Rerun it with --config.rerun={name} "
          "(its directory is moved aside, as are those of stages started from it, by naming them too), or use "
          "another --workdir")
    say(f"stage {name}: already finished with this config ({export_dir})")
    return export_dir, {**{k: v for k, v in done.items() if k != "config"}, "skipped": True}
  start = time.perf_counter()
  trainer = Trainer(config, stage_dir)  # resumes from the stage's newest checkpoint, if any
  try:
    history = trainer.run()  # exports to <stage>/adapter or <stage>/hf at the end (config.export)
    stopped_at = trainer.step if trainer.preempted and trainer.step < config.total_steps else None
  finally:
    trainer.close()
  if stopped_at is not None:
    raise StagePreempted(f"stage {name} stopped by a signal or preemption notice at step {stopped_at} of "
                         f"{config.total_steps} (checkpoint saved in {stage_dir}); the same command resumes it")
  if not os.path.isdir(export_dir):
    raise RuntimeError(f"stage {name} finished without writing its export {export_dir}")
  if config.finetune != "lora":
    mark_attention(export_dir, STAGE_ATTENTION[name])
  last = history[-1] if history else {}
  summary = {"objective": config.objective, "steps": config.total_steps,
             "seconds": round(time.perf_counter() - start, 1),
             **{k: v for k, v in last.items() if k.startswith(("loss", "eval_"))}}
  write_json(done_marker, {**summary, "config": identity})
  say(f"stage {name}: done in {summary['seconds']:.0f}s, " + ", ".join(
      f"{k}={v:.4g}" for k, v in summary.items() if k.startswith("eval_")))
  return export_dir, summary


def held_out_task(c) -> ArithmeticTask:
  """The evaluation split of the config's task (the same seed and sizes as the training data)."""
  return ArithmeticTask(seed=c.seed, train=c.task.train, test=c.task.test, min_steps=c.task.min_steps,
                        max_steps=c.task.max_steps, style=c.task.get("style", "terse"))


def stages(c) -> list[tuple[str, str, dict]]:
  """(stage name, what it is, stage_config keywords) in training order; a stage of 0 steps is left out."""
  out = [("ar", "AR pre-training of the Dream-layout model (also the AR baseline)",
          dict(objective="ar", steps=c.ar.steps, lr=c.ar.lr, warmup=c.ar.warmup, decay=c.ar.decay, family="dream")),
         ("teacher", "MDM adaptation of the AR model with shifted logits (the teacher)",
          dict(objective="mdm", steps=c.teacher.steps, lr=c.teacher.lr, warmup=c.teacher.warmup, decay=c.teacher.decay,
               semi_ar=c.teacher.get("semi_ar", 0.0), suffix_weight=c.teacher.get("suffix_weight", 1.0),
               ar_weight=c.teacher.get("ar_weight", 0.0), init="ar")),
         ("student", "D2F asymmetric distillation of the teacher (the student)",
          dict(objective="distill", steps=c.student.steps, lr=c.student.lr, warmup=c.student.warmup,
               decay=c.student.decay, finetune=c.student.finetune, lora_rank=c.student.lora_rank, init="teacher"))]
  if c.llada_teacher.steps > 0:
    out.append(("llada_teacher", "LLaDA-layout teacher trained from scratch with the MDM objective",
                dict(objective="mdm", steps=c.llada_teacher.steps, lr=c.llada_teacher.lr,
                     warmup=c.llada_teacher.warmup, family="llada")))
  return out


def run(c, workdir: str) -> dict:
  """The whole reproduction into `workdir`; returns the results payload (also written as files). A workdir
  another live process runs in is refused (workdir_lock.WorkdirLocked)."""
  with workdir_lock.hold(workdir, what="main job workdir"):
    return _run(c, workdir)


def write_data(c, workdir: str) -> tuple[str, str]:
  """(tokenizer dir, training npz) of the config's task under `workdir`/data, each written once."""
  data_dir = os.path.join(workdir, "data")
  os.makedirs(data_dir, exist_ok=True)
  tokenizer_dir = data_lib.write_tokenizer(os.path.join(data_dir, "tokenizer"))
  return tokenizer_dir, data_lib.write_training_data(
      os.path.join(data_dir, "train.npz"), seed=c.seed, train=c.task.train, test=c.task.test, seq_len=c.seq_len,
      min_steps=c.task.min_steps, max_steps=c.task.max_steps, style=c.task.get("style", "terse"))


def _run(c, workdir: str) -> dict:
  check_config(c)
  os.makedirs(workdir, exist_ok=True)
  say(f"data: {c.task.train} training problems from the task generator, {c.task.test} held out")
  tokenizer_dir, data_path = write_data(c, workdir)
  exports, summaries, identities = {}, {}, {}
  plan = stages(c)
  rerun = {s.strip() for s in str(c.get("rerun", "") or "").split(",") if s.strip()}
  unknown = rerun - {name for name, _, _ in plan} - {"all"}
  if unknown:
    raise StageConfigChanged(f"config.rerun names unknown stage(s) {sorted(unknown)}; stages: "
                             f"{[name for name, _, _ in plan]} (or 'all')")
  data_fields = data_identity(c)
  for i, (name, what, kw) in enumerate(plan):
    kw = dict(kw)
    init = kw.pop("init", None)
    say(f"stage {i + 1}/{len(plan)} {name}: {what}, {kw['steps']} steps (progress bar '{kw['objective']}')")
    config = stage_config(c, data_path=data_path, tokenizer_dir=tokenizer_dir,
                          model_path=exports[init] if init else None, **kw)
    identities[name] = stage_identity(config, identities.get(init), data_fields)
    exports[name], summaries[name] = train_stage(name, config, workdir, identities[name],
                                                 rerun=name in rerun or "all" in rerun)

  student_dir = exports["student"]
  models = {"teacher": d2f_jax.load_model(exports["teacher"]), "ar": d2f_jax.load_model(exports["ar"]),
            "student": (d2f_jax.load_model(exports["teacher"], lora_dir=student_dir) if c.student.finetune == "lora"
                        else d2f_jax.load_model(student_dir))}
  if "llada_teacher" in exports:
    models["llada_teacher"] = d2f_jax.load_model(exports["llada_teacher"])
  say(f"evaluation: {len(evaluation.decode_rows(c, models))} decoding rows on {c.task.test} held-out problems")
  rows = evaluation.evaluate(c, models, held_out_task(c), workdir, progress=say)
  say("CPU ceiling: timing the AR step and the D2F step at the measured window widths")
  steps = ceiling.add_ceiling(rows, models, c)
  payload = report.write_results(workdir, rows, summaries, c.to_dict(), steps)
  report.plot_throughput(workdir, rows)
  report.plot_trace(workdir, *evaluation.first_trace(c, models["student"], held_out_task(c).load(1)[0]))
  say(f"wrote {os.path.join(workdir, 'results.md')}")
  return payload

