"""objective 'mdm' with `mdm.ar_weight`: the masked-diffusion loss plus that times the causal next-token loss of
the clean rows (a second pass of the same model), kept apart from the plain objectives it is built from."""

import os

import jax
import numpy as np
import pytest
from flax import nnx

from d2f_jax.models import LLADA_8B, TINY_DREAM, TINY_LLADA, LoraConfig
from d2f_jax.train import config as config_lib
from d2f_jax.train.metrics import forward_flops_per_token, train_flops_per_token
from d2f_jax.train.model import TrainModels
from d2f_jax.train.optim import OptimSpec
from d2f_jax.train.schedule import Schedule
from d2f_jax.train.step import StepSpec, loss_and_grads, summarize
from d2f_jax.train.trainer import Trainer
from model_utils import random_model, random_tokens
from test_objectives import count_task, micro_config  # noqa: F401  (count_task: the fixture)

WEIGHT = 0.5
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _batch(config, length=16):
  """Four rows with EOS padding from different columns and prompts of 3, 5, 0 and 2 tokens."""
  tokens = np.array(random_tokens(config, 4, length, seed=7))
  for row, eos_at in enumerate((9, 12, 6, 15)):
    tokens[row, eos_at:] = config.eos_token_id
  return {"tokens": jax.numpy.asarray(tokens), "prompt_len": jax.numpy.array([3, 5, 0, 2], jax.numpy.int32)}


def _run(config, objective, ar_weight=0.0, micro=1):
  params = nnx.to_pure_dict(nnx.state(random_model(config, seed=3), nnx.Param))
  models = TrainModels.create(config, None, teacher=False)
  spec = StepSpec(models, Schedule(), OptimSpec(), block_size=4, micro_batches=micro, objective=objective,
                  mdm_ar_weight=ar_weight)
  batch = _batch(config)
  return jax.jit(lambda p: loss_and_grads(spec, p, {}, batch, jax.random.PRNGKey(5)))(params)


def test_the_mixed_loss_is_the_mdm_loss_plus_the_weighted_ar_loss_sums_and_gradients():
  """Same key, same masks: the mixed sums are mdm's plus WEIGHT x ar's (each pass as its own objective), and so
  are the gradients once each is scaled back from its mean (mdm over response tokens, ar over its targets)."""
  config = TINY_DREAM.replace(num_layers=1)
  g_mix, s_mix = _run(config, "mdm", WEIGHT)
  g_mdm, s_mdm = _run(config, "mdm")
  g_ar, s_ar = _run(config, "ar")
  for name in ("masked", "response", "correct"):
    assert float(s_mix[name]) == float(s_mdm[name]), name
  np.testing.assert_allclose(float(s_mix["mdm_ce"]), float(s_mdm["ce"]), rtol=1e-6)
  np.testing.assert_allclose(float(s_mix["ar_ce"]), float(s_ar["ce"]), rtol=1e-6)
  assert float(s_mix["ar_targets"]) == float(s_ar["targets"]) > 0
  np.testing.assert_allclose(float(s_mix["ce"]), float(s_mdm["ce"]) + WEIGHT * float(s_ar["ce"]), rtol=1e-6)
  response, targets = float(s_mix["response"]), float(s_ar["targets"])
  assert targets < response  # padding after the first EOS is response, not an AR target: the weights differ
  for mix, mdm, ar in zip(jax.tree.leaves(g_mix), jax.tree.leaves(g_mdm), jax.tree.leaves(g_ar)):
    want = np.asarray(mdm) + WEIGHT * np.asarray(ar) * targets / response
    np.testing.assert_allclose(np.asarray(mix), want, rtol=1e-4, atol=1e-6 * float(np.abs(want).max()))
  metrics = summarize(s_mix, "mdm")
  np.testing.assert_allclose(float(metrics["loss"]), float(s_mix["ce"]) / response, rtol=1e-6)
  np.testing.assert_allclose(float(metrics["mdm_loss"]), float(summarize(s_mdm, "mdm")["loss"]), rtol=1e-6)
  np.testing.assert_allclose(float(metrics["ar_loss"]), float(summarize(s_ar, "ar")["loss"]), rtol=1e-6)
  np.testing.assert_allclose(float(metrics["ar_accuracy"]), float(summarize(s_ar, "ar")["accuracy"]), rtol=1e-6)
  assert "ar_loss" not in summarize(s_mdm, "mdm")  # the plain objective reports what it did before


def test_the_mixed_loss_accumulates_exactly_over_microbatches():
  config = TINY_DREAM.replace(num_layers=1)
  (g1, s1), (g2, s2) = _run(config, "mdm", WEIGHT, micro=1), _run(config, "mdm", WEIGHT, micro=2)
  assert s1.keys() == s2.keys() and "ar_ce" in s1
  for k in s1:
    np.testing.assert_allclose(float(s1[k]), float(s2[k]), rtol=1e-6, err_msg=k)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6 * float(np.abs(a).max()))


def test_an_unshifted_model_is_refused_naming_the_field():
  """LLaDA's output row i predicts token i under the MDM loss and would predict i + 1 under the AR loss."""
  models = TrainModels.create(TINY_LLADA.replace(num_layers=1), None, teacher=False)
  with pytest.raises(ValueError, match=r"mdm.ar_weight=0.5: needs a model with Dream's shifted logits"):
    StepSpec(models, Schedule(), OptimSpec(), block_size=4, objective="mdm", mdm_ar_weight=0.5)


@pytest.mark.parametrize("objective, weight, message", [
    ("mdm", -0.1, r"config.mdm.ar_weight=-0.1: must be >= 0"),
    ("distill", 0.5,
     r"config.mdm.ar_weight=0.5: mixes the AR loss into objective 'mdm' only \(objective is 'distill'\)"),
    ("ar", 0.5, r"objective is 'ar'"),
])
def test_config_refuses_a_bad_weight_by_name(objective, weight, message):
  c = config_lib.load_config_file(os.path.join(ROOT, "configs", "tiny.py"))
  c.objective = objective
  c.mdm.ar_weight = weight
  with pytest.raises(ValueError, match=message):
    config_lib.validate(c)
  c.mdm.ar_weight = 0.0
  config_lib.validate(c)  # the same config at the default weight is fine


def test_flops_count_the_second_pass():
  fwd, lora = forward_flops_per_token(LLADA_8B, 1024), LoraConfig()
  assert train_flops_per_token(LLADA_8B, 1024, None, teacher=False, passes=2) == 6 * fwd
  assert train_flops_per_token(LLADA_8B, 1024, lora, teacher=False, passes=2) == pytest.approx(
      4 * forward_flops_per_token(LLADA_8B, 1024, lora))
  assert config_lib.base_config().mdm.ar_weight == 0.0  # off unless asked for


def test_the_trainer_logs_both_parts_and_counts_both_passes(count_task, tmp_path):
  """A few Trainer steps of the mixed objective on the counting task (Dream's shifted logits): every logged row
  has the total and both parts, and the FLOPs per token count the causal pass beside the masked one."""
  overrides = {"mdm.ar_weight": WEIGHT, "total_steps": 4, "model.preset": "tiny-dream"}
  trainer = Trainer(micro_config("mdm", count_task, **overrides), str(tmp_path / "mix"))
  history = trainer.run()
  trainer.close()
  rows = [h for h in history if "loss" in h]
  assert len(rows) == 4 and all(np.isfinite([h["loss"], h["mdm_loss"], h["ar_loss"]]).all() for h in rows)
  assert all(0.0 <= h["ar_accuracy"] <= 1.0 for h in rows)
  plain = Trainer(micro_config("mdm", count_task, **{**overrides, "mdm.ar_weight": 0.0}), str(tmp_path / "plain"))
  assert trainer.flops_per_token == pytest.approx(2 * plain.flops_per_token)
  plain.close()
