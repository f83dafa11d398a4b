"""The tiny distillation run end to end: it learns, resumes exactly after a crash or SIGTERM, and exports a
PEFT adapter that the converter loads back with the trained student's logits."""

import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import d2f_jax
from d2f_jax import convert
from d2f_jax.models import align_logits, attention_ids
from d2f_jax.train.config import load_config_file
from d2f_jax.train.trainer import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 12


def tiny_config(**overrides):
  c = load_config_file(os.path.join(ROOT, "configs", "tiny.py"))
  c.total_steps = STEPS
  c.data.synthetic_examples = 144
  c.data.eval_examples = 16
  c.checkpoint.every = 4
  c.log_every = 1
  c.eval_every = 1000  # baseline at step 0 and the final step only
  c.eval_batches = 2
  c.progress_bar = False
  c.update_from_flattened_dict(overrides)
  return c


def _losses(history):
  return {h["step"]: h["loss"] for h in history if "loss" in h}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("uninterrupted"))
  trainer = Trainer(tiny_config(), workdir)
  history = trainer.run()
  trainer.close()
  return trainer, history, workdir


def test_distilled_student_beats_the_undistilled_one_on_held_out_data(uninterrupted):
  _, history, workdir = uninterrupted
  before, after = history[0], history[-1]
  assert before["step"] == 0 and after["step"] == STEPS
  assert after["eval_kl"] < 0.8 * before["eval_kl"], (before, after)
  assert after["eval_loss"] < before["eval_loss"]
  assert after["eval_mask_rate"] == before["eval_mask_rate"], "held-out batches are noised identically"
  assert all(np.isfinite(h["loss"]) and h["tokens_per_s"] > 0 and 0 < h["mfu"] < 1 for h in history[1:])
  events = os.listdir(os.path.join(workdir, "tb"))
  assert events and os.path.getsize(os.path.join(workdir, "tb", events[0])) > 0


class _SigtermAt:
  """Data iterator wrapper that delivers SIGTERM to this process while fetching batch `at` (1-based)."""

  def __init__(self, inner, at):
    self.inner, self.at, self.count = inner, at, 0

  def __next__(self):
    self.count += 1
    if self.count == self.at:
      os.kill(os.getpid(), signal.SIGTERM)
    return next(self.inner)

  def get_state(self):
    return self.inner.get_state()


def test_crash_and_sigterm_resume_with_the_same_losses(uninterrupted, tmp_path):
  _, history, _ = uninterrupted
  expected = _losses(history)
  workdir = str(tmp_path)
  config = tiny_config()
  got = {}
  first = Trainer(config, workdir)
  got.update(_losses(first.run(num_steps=6)))  # "killed" after step 6: the last checkpoint is step 4
  first.close()
  second = Trainer(config, workdir)
  assert second.step == 4
  second.data = _SigtermAt(second.data, at=3)  # SIGTERM during step 7: save step 7, then stop
  got.update(_losses(second.run()))
  second.close()
  third = Trainer(config, workdir)
  assert third.step == 7, "SIGTERM saved the step it finished"
  got.update(_losses(third.run()))
  third.close()
  assert sorted(got) == list(range(1, STEPS + 1))
  for step in range(1, STEPS + 1):
    np.testing.assert_allclose(got[step], expected[step], rtol=1e-6, err_msg=f"step {step}")


def test_exported_adapter_loads_back_with_the_students_logits(uninterrupted):
  trainer, _, workdir = uninterrupted
  adapter = os.path.join(workdir, "adapter")
  assert os.path.isfile(os.path.join(adapter, "adapter_config.json"))
  base_dir = os.path.join(workdir, "synthetic", "model")
  tokens = jnp.asarray(trainer.eval_data[0]["tokens"])
  prompt_len = jnp.asarray(trainer.eval_data[0]["prompt_len"])
  batch, length = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(length), (batch, length))
  teacher, student = trainer.modules()
  config = trainer.models.config

  def ours(model, mode):
    ids = attention_ids(positions, mode, prompt_len=prompt_len, block_size=trainer.config.block_size)
    return np.asarray(align_logits(model(tokens, positions, ids)[0], config))

  merged = d2f_jax.load_model(base_dir, lora_dir=adapter)
  np.testing.assert_allclose(np.asarray(merged.logits(tokens)), ours(student, "bidirectional"), rtol=1e-4, atol=1e-4)
  separate = d2f_jax.load_model(base_dir, lora_dir=adapter, merge_lora=False)
  got = separate.logits(tokens, mode="block_causal", prompt_len=prompt_len, block_size=trainer.config.block_size)
  np.testing.assert_allclose(np.asarray(got), ours(student, "block_causal"), rtol=1e-4, atol=1e-4)
  # The adapter is not a no-op: the student's logits moved away from the base model's.
  assert np.abs(ours(student, "block_causal") - ours(teacher, "block_causal")).max() > 1e-3


def test_full_finetune_from_a_converted_dir_exports_a_loadable_hf_checkpoint(uninterrupted, tmp_path):
  """Base restored from a converted directory straight into its shardings (same values as from HF), full
  fine-tune, exported as an HF checkpoint that loads back with the student's logits."""
  trainer, _, workdir = uninterrupted
  hf_dir = os.path.join(workdir, "synthetic", "model")
  converted = convert.convert_hf_dir(hf_dir, str(tmp_path / "converted"), progress=False)
  config = tiny_config(**{"finetune": "full", "model.synthetic": False, "model.path": converted, "total_steps": 2,
                          "data.path": os.path.join(workdir, "synthetic", "qa.jsonl")})
  full = Trainer(config, str(tmp_path / "run"))
  for a, b in zip(jax.tree.leaves(full.frozen), jax.tree.leaves(trainer.frozen)):  # trainer: from the HF dir
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  full.run()
  full.close()
  exported = d2f_jax.load_model(os.path.join(full.workdir, "hf"))
  tokens = jnp.asarray(full.eval_data[0]["tokens"])
  _, student = full.modules()
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  ours = align_logits(student(tokens, positions, attention_ids(positions, "bidirectional"))[0], full.models.config)
  np.testing.assert_allclose(np.asarray(exported.logits(tokens)), np.asarray(ours), rtol=1e-5, atol=1e-5)
  assert exported.tokenizer is not None
