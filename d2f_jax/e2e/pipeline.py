"""The stages of the miniature reproduction, each resumable: data, teacher, AR baseline, student, evaluation.

Every training stage is the project's one Trainer with a different objective (mdm, ar, distill) and writes
a Hugging Face-format export; a finished stage (its export exists) is skipped when the run is restarted,
an unfinished one resumes from its newest checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time

import jax
import ml_collections

import d2f_jax
from d2f_jax.decode import DecodeConfig, generate
from d2f_jax.e2e import data as data_lib
from d2f_jax.e2e import report
from d2f_jax.evals.data import write_json
from d2f_jax.evals.runner import encode_prompts, run_benchmark
from d2f_jax.tasks import tokenizer as tokenizer_lib
from d2f_jax.tasks.arithmetic import ArithmeticTask
from d2f_jax.train import config as train_config
from d2f_jax.train.trainer import Trainer

log = logging.getLogger(__name__)


def model_overrides(c: ml_collections.ConfigDict) -> dict:
  """ModelConfig fields of the tiny LLaDA-layout model, special ids from the task's tokenizer."""
  return dict(vocab_size=len(tokenizer_lib.vocabulary()), family="llada", qkv_bias=False, logit_shift=False,
              tie_embeddings=False, dtype="float32", param_dtype="float32", **c.model.to_dict(),
              **tokenizer_lib.special_ids())


def stage_config(c, *, objective: str, data_path: str, tokenizer_dir: str, steps: int, lr: float, warmup: int,
                 model_path: str | None = None, finetune: str = "full", lora_rank: int = 32):
  """A Trainer config for one stage on the pre-tokenized task data."""
  t = train_config.base_config()
  t.objective = objective
  t.seed = c.seed
  t.total_steps = steps
  t.batch_size = c.batch_size
  t.block_size = c.block_size
  if model_path is None:
    t.model.init = "random"
    t.model.overrides = ml_collections.ConfigDict(model_overrides(c))
  else:
    t.model.path = model_path
  t.model.dtype = "float32"
  t.finetune = finetune
  t.lora.update(dict(rank=lora_rank, alpha=float(lora_rank), dropout=0.0))
  t.data.source = "npz"
  t.data.path = data_path
  t.data.tokenizer = tokenizer_dir
  t.data.seq_len = c.seq_len
  t.data.eval_examples = 4 * c.batch_size
  t.optim.lr = lr
  t.optim.warmup_steps = warmup
  t.optim.weight_decay = 0.0 if model_path is None else t.optim.weight_decay
  t.mesh.update(dict(data=1, fsdp=-1, tensor=1))
  t.checkpoint.update(dict(every=max(steps // 4, 1), keep=1))
  t.log_every = max(steps // 20, 1)
  t.eval_every = max(steps // 4, 1)
  t.eval_batches = 2
  train_config.validate(t)
  return t


def train_stage(name: str, config, workdir: str) -> tuple[str, dict]:
  """Run (or resume, or skip) one training stage; returns (export dir, summary)."""
  stage_dir = os.path.join(workdir, name)
  done_marker = os.path.join(stage_dir, "stage_done.json")
  export_dir = os.path.join(stage_dir, "adapter" if config.finetune == "lora" else "hf")
  if os.path.exists(done_marker):
    log.info("stage %s already finished: %s", name, export_dir)
    with open(done_marker) as f:
      return export_dir, {**json.load(f), "skipped": True}
  start = time.perf_counter()
  trainer = Trainer(config, stage_dir)  # resumes from the stage's newest checkpoint, if any
  try:
    history = trainer.run()  # exports to <stage>/adapter or <stage>/hf at the end (config.export)
  finally:
    trainer.close()
  if not os.path.isdir(export_dir):
    raise RuntimeError(f"stage {name} finished without writing its export {export_dir}")
  last = history[-1] if history else {}
  summary = {"objective": config.objective, "steps": config.total_steps, "seconds": time.perf_counter() - start,
             **{k: v for k, v in last.items() if k.startswith(("loss", "eval_"))}}
  write_json(done_marker, summary)
  return export_dir, summary


def decode_configs(c) -> list[tuple[str, str, str, DecodeConfig]]:
  """(method label, model role, settings text, DecodeConfig) for every row of the comparison."""
  common = dict(block_size=c.block_size, max_new_tokens=c.max_new_tokens, prompt_buckets=64)
  rows = [("vanilla", "teacher", f"{c.max_new_tokens} steps",
           DecodeConfig(method="vanilla", steps=c.max_new_tokens, **common)),
          ("threshold", "teacher", f"tau_conf={c.threshold_tau_conf}",
           DecodeConfig(method="threshold", tau_conf=c.threshold_tau_conf, **common))]
  for tau_add, tau_act, tau_conf in c.d2f_sweep:
    rows.append(("d2f", "student", f"add={tau_add} act={tau_act} conf={tau_conf}",
                 DecodeConfig(method="d2f", tau_add=tau_add, tau_act=tau_act, tau_conf=tau_conf,
                              max_blocks_in_flight=c.max_blocks_in_flight, **common)))
  rows.append(("ar", "ar", "KV cache", DecodeConfig(method="ar", **common)))
  return rows


def held_out_task(c) -> ArithmeticTask:
  """The evaluation split of the config's task (the same seed and sizes as the training data)."""
  return ArithmeticTask(seed=c.seed, train=c.task.train, test=c.task.test, min_steps=c.task.min_steps,
                        max_steps=c.task.max_steps)


def evaluate(c, models: dict, out_dir: str) -> list[dict]:
  task = held_out_task(c)
  rows = []
  for i, (method, role, settings, dc) in enumerate(decode_configs(c)):
    result = run_benchmark(models[role], task, dc, batch_size=c.eval_batch_size,
                           out_dir=os.path.join(out_dir, "eval", f"{i:02d}_{method}"), log=log.info)
    speed = result["speed"]
    rows.append({"method": method, "model": role, "settings": settings, "accuracy": result["score"],
                 "total": result["total"], "tokens_per_s": speed["tokens_per_s"],
                 "tokens_per_forward": speed["tokens_per_forward"], "latency_ms": 1000 * speed["latency_s_mean"],
                 "decode": dataclasses.asdict(dc)})
  return report.add_ratios(rows)


def run(c, workdir: str) -> dict:
  """The whole reproduction into `workdir`; returns the results payload (also written as files)."""
  os.makedirs(workdir, exist_ok=True)
  data_dir = os.path.join(workdir, "data")
  os.makedirs(data_dir, exist_ok=True)
  tokenizer_dir = data_lib.write_tokenizer(os.path.join(data_dir, "tokenizer"))
  data_path = data_lib.write_training_data(
      os.path.join(data_dir, "train.npz"), seed=c.seed, train=c.task.train, test=c.task.test, seq_len=c.seq_len,
      min_steps=c.task.min_steps, max_steps=c.task.max_steps)
  common = dict(data_path=data_path, tokenizer_dir=tokenizer_dir)
  stages = {}
  teacher_dir, stages["teacher (mdm)"] = train_stage("teacher", stage_config(
      c, objective="mdm", steps=c.teacher.steps, lr=c.teacher.lr, warmup=c.teacher.warmup, **common), workdir)
  ar_dir, stages["ar baseline"] = train_stage("ar", stage_config(
      c, objective="ar", steps=c.ar.steps, lr=c.ar.lr, warmup=c.ar.warmup, **common), workdir)
  student_dir, stages["d2f student"] = train_stage("student", stage_config(
      c, objective="distill", steps=c.student.steps, lr=c.student.lr, warmup=c.student.warmup,
      model_path=teacher_dir, finetune=c.student.finetune, lora_rank=c.student.lora_rank, **common), workdir)

  teacher = d2f_jax.load_model(teacher_dir)
  models = {"teacher": teacher, "ar": d2f_jax.load_model(ar_dir),
            "student": (d2f_jax.load_model(teacher_dir, lora_dir=student_dir) if c.student.finetune == "lora"
                        else d2f_jax.load_model(student_dir))}
  rows = evaluate(c, models, workdir)
  payload = report.write_results(workdir, rows, stages, c.to_dict())
  report.plot_throughput(workdir, rows)
  _trace_picture(c, models["student"], workdir)
  return payload


def _trace_picture(c, student, workdir: str) -> None:
  """Decode the first held-out problem with the paper's default thresholds and draw when each token landed."""
  task = held_out_task(c)
  item = task.load(1)[0]
  tau_add, tau_act, tau_conf = c.d2f_sweep[0]
  dc = DecodeConfig(method="d2f", block_size=c.block_size, max_new_tokens=c.max_new_tokens, tau_add=tau_add,
                    tau_act=tau_act, tau_conf=tau_conf, max_blocks_in_flight=c.max_blocks_in_flight)
  result = generate(student, encode_prompts(student, [item]), dc, key=jax.random.key(c.seed))
  report.plot_trace(workdir, jax.device_get(result.trace)[0], c.block_size,
                    f"D2F decoding of one held-out problem ({int(result.forwards[0])} forwards, "
                    f"{int(result.lengths[0])} tokens)")
