"""The objectives one Trainer can optimise, as a small table the jitted step dispatches on.

Each objective says how a batch {'tokens' [B, T], 'prompt_len' [B]} becomes loss inputs (`prepare`: noise,
targets; every leaf keeps the batch axis first so microbatches can split it), how inputs become batch sums
(`sums`: 'ce' is the differentiated numerator), which sum is the denominator of the mean loss, and how sums
become metrics. Sums, not means, cross microbatches and shards, so accumulation is exact.

  distill  D2F asymmetric distillation: block-causal student vs a frozen bidirectional teacher (loss_distill.py)
  mdm      LLaDA masked diffusion, bidirectional, 1/t weighted, per response token (loss_mdm.py); with
           `ar_weight`, plus that times the causal next-token CE of the clean rows (loss_ar.py), summed over
           the same response tokens (so the AR term is its per-target mean x #targets / #response)
  ar       causal next-token prediction up to the first EOS (loss_ar.py)
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from d2f_jax.train import loss_ar, loss_mdm
from d2f_jax.train.loss_distill import distill_sums
from d2f_jax.train.masking import noise_batch


@dataclasses.dataclass(frozen=True)
class Objective:
  prepare: Callable  # (spec, key, batch) -> inputs, a pytree of [B, ...] arrays
  sums: Callable  # (spec, trainable, frozen, inputs, dropout_key) -> {'ce': numerator, ...}
  denominator: str  # the entry of sums that the summed 'ce' (and its gradient) is divided by
  summarize: Callable  # sums -> metrics, 'loss' first
  teacher: bool  # holds a frozen teacher (counted in FLOPs, kept beside a full fine-tune)
  attention: str  # how the trained model attends: its ModelConfig.attention_kind in exports (ATTENTION_KEY)


def _distill_prepare(spec, key, batch):
  noised = noise_batch(key, batch["tokens"], batch["prompt_len"], block_size=spec.block_size, schedule=spec.schedule,
                       mask_token_id=spec.models.config.mask_token_id)
  return noised, batch["prompt_len"]


def _distill_sums(spec, trainable, frozen, inputs, dropout_key):
  noised, prompt_len = inputs
  teacher, student = spec.models.modules(trainable, frozen)
  return distill_sums(teacher, student, noised, prompt_len, block_size=spec.block_size, dropout_key=dropout_key,
                      chunk=spec.loss_chunk)


def _distill_summarize(sums):
  count = jnp.maximum(sums["masked"], 1.0)
  return {"loss": sums["ce"] / count, "kl": sums["kl"] / count,
          "mask_rate": sums["masked"] / jnp.maximum(sums["response"], 1.0)}


def _mdm_prepare(spec, key, batch):
  noised = loss_mdm.noise_mdm(key, batch["tokens"], batch["prompt_len"], eps=spec.mdm_eps,
                              mask_token_id=spec.models.config.mask_token_id, semi_ar=spec.mdm_semi_ar,
                              window=spec.mdm_window, suffix_weight=spec.mdm_suffix_weight)
  if not spec.mdm_ar_weight:
    return noised
  return noised, loss_ar.target_mask(batch["tokens"], batch["prompt_len"], spec.models.config.eos_token_id)


def _mdm_sums(spec, trainable, frozen, inputs, dropout_key):
  model = spec.models.student(trainable, frozen)
  if not spec.mdm_ar_weight:
    return loss_mdm.mdm_sums(model, inputs, dropout_key=dropout_key, chunk=spec.loss_chunk)
  noised, targets = inputs  # targets [B, T] bool: the answer and its first EOS
  mdm_key, ar_key = (None, None) if dropout_key is None else jax.random.split(dropout_key)
  sums = loss_mdm.mdm_sums(model, noised, dropout_key=mdm_key, chunk=spec.loss_chunk)
  ar = loss_ar.ar_sums(model, noised.clean, targets, dropout_key=ar_key, chunk=spec.loss_chunk)
  # The router statistics (a mixture of experts) stay the masked pass's.
  return {**sums, "ce": sums["ce"] + spec.mdm_ar_weight * ar["ce"], "mdm_ce": sums["ce"], "ar_ce": ar["ce"],
          "ar_targets": ar["targets"], "ar_correct": ar["correct"]}


def _mdm_summarize(sums):
  out = loss_mdm.summarize(sums)
  if "ar_ce" in sums:  # the mixed loss: each part beside the total
    ar_targets = jnp.maximum(sums["ar_targets"], 1.0)
    out.update(mdm_loss=sums["mdm_ce"] / jnp.maximum(sums["response"], 1.0), ar_loss=sums["ar_ce"] / ar_targets,
               ar_accuracy=sums["ar_correct"] / ar_targets)
  return out


def _ar_prepare(spec, key, batch):  # deterministic: no noise
  del key
  tokens = batch["tokens"]
  return {"tokens": tokens, "targets": loss_ar.target_mask(tokens, batch["prompt_len"],
                                                           spec.models.config.eos_token_id)}


def _ar_sums(spec, trainable, frozen, inputs, dropout_key):
  return loss_ar.ar_sums(spec.models.student(trainable, frozen), inputs["tokens"], inputs["targets"],
                         dropout_key=dropout_key, chunk=spec.loss_chunk)


OBJECTIVES: dict[str, Objective] = {
    "distill": Objective(_distill_prepare, _distill_sums, "masked", _distill_summarize, teacher=True,
                         attention="block_causal"),
    "mdm": Objective(_mdm_prepare, _mdm_sums, "response", _mdm_summarize, teacher=False, attention="bidirectional"),
    "ar": Objective(_ar_prepare, _ar_sums, "targets", loss_ar.summarize, teacher=False, attention="causal"),
}


def get(name: str) -> Objective:
  if name not in OBJECTIVES:
    raise ValueError(f"config.objective={name!r} is unknown; known: {sorted(OBJECTIVES)}")
  return OBJECTIVES[name]
