"""The distillation loss against an independent numpy computation; chunking and accumulation are exact."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from d2f_jax.models import TINY_DREAM, TINY_LLADA, LoraConfig, Transformer
from d2f_jax.train.loss_distill import distill_sums
from d2f_jax.train.masking import noise_batch
from d2f_jax.train.model import BASE, TrainModels
from d2f_jax.train.optim import OptimSpec
from d2f_jax.train.schedule import Schedule
from d2f_jax.train.step import StepSpec, loss_and_grads
from model_utils import random_model, random_tokens

LORA = LoraConfig(rank=4, alpha=8.0, dropout=0.0)
BLOCK = 4


def _setup(config, batch=3, length=16, seed=0):
  model = random_model(config, LORA, seed=seed)  # LoRA factors are random too, so student != teacher
  frozen = nnx.to_pure_dict(nnx.state(model, BASE))
  trainable = nnx.to_pure_dict(nnx.state(model, nnx.LoRAParam))
  tokens = random_tokens(config, batch, length, seed=seed)
  prompt_len = jnp.array([3, 5, 0][:batch], jnp.int32)
  return model, frozen, trainable, tokens, prompt_len


def _numpy_loss(config, student, frozen, noised, prompt_len):
  """softmax(teacher) . -log_softmax(student) on masked positions, weighted 1/p, / #masked, in float64."""
  batch, length = noised.tokens.shape
  positions = jnp.broadcast_to(jnp.arange(length), (batch, length))
  teacher = nnx.merge(nnx.split(nnx.eval_shape(lambda: Transformer(config, None, rngs=nnx.Rngs(0))))[0], frozen)
  pos = np.arange(length)[None]
  pl = np.asarray(prompt_len)[:, None]
  s_ids = np.where(pos < pl, -1, (pos - pl) // BLOCK).astype(np.int32)  # the block-causal rule, by hand
  t_logits = np.asarray(teacher(noised.tokens, positions, jnp.zeros((batch, length), jnp.int32))[0], np.float64)
  s_logits = np.asarray(student(noised.tokens, positions, jnp.asarray(s_ids))[0], np.float64)
  if config.logit_shift:  # row i predicts token i from output i-1; row 0 keeps its own
    t_logits = np.concatenate([t_logits[:, :1], t_logits[:, :-1]], 1)
    s_logits = np.concatenate([s_logits[:, :1], s_logits[:, :-1]], 1)

  def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))

  t_logp, s_logp = log_softmax(t_logits), log_softmax(s_logits)
  ce = -(np.exp(t_logp) * s_logp).sum(-1)
  kl = (np.exp(t_logp) * (t_logp - s_logp)).sum(-1)
  masked = np.asarray(noised.masked)
  w = np.asarray(noised.weight, np.float64)
  return (w * ce)[masked].sum() / masked.sum(), (w * kl)[masked].sum() / masked.sum()


@pytest.mark.parametrize("config", [TINY_LLADA, TINY_DREAM], ids=["llada", "dream"])
def test_loss_equals_numpy(config):
  model, frozen, trainable, tokens, prompt_len = _setup(config)
  noised = noise_batch(jax.random.PRNGKey(1), tokens, prompt_len, block_size=BLOCK, schedule=Schedule(),
                       mask_token_id=config.mask_token_id)
  teacher, student = TrainModels.create(config, LORA).modules(trainable, frozen)
  expected_ce, expected_kl = _numpy_loss(config, model, frozen, noised, prompt_len)
  for chunk in (0, 4):  # chunked logits give the same sums
    fn = jax.jit(lambda n: distill_sums(teacher, student, n, prompt_len, block_size=BLOCK, chunk=chunk))
    sums = fn(noised)
    count = float(sums["masked"])
    assert count == np.asarray(noised.masked).sum() > 0
    np.testing.assert_allclose(float(sums["ce"]) / count, expected_ce, rtol=1e-5)
    np.testing.assert_allclose(float(sums["kl"]) / count, expected_kl, rtol=1e-4, atol=1e-6)
  assert expected_kl > 1e-4  # a real gap between block-causal student and bidirectional teacher


def test_eos_padding_is_response_and_the_prompt_stays_clean():
  config = TINY_LLADA
  tokens = random_tokens(config, 2, 12).at[:, 8:].set(config.eos_token_id)
  prompt_len = jnp.array([3, 5], jnp.int32)
  noised = noise_batch(jax.random.PRNGKey(2), tokens, prompt_len, block_size=BLOCK,
                       schedule=Schedule(low=0.99, high=1.0), mask_token_id=config.mask_token_id)
  masked = np.asarray(noised.masked)
  assert masked[:, 8:].all(), "right padding (EOS) is part of the response"
  assert not masked[0, :3].any() and not masked[1, :5].any()
  np.testing.assert_array_equal(np.asarray(noised.response), np.arange(12)[None] >= np.array([[3], [5]]))


def _spec(config, lora, micro, block=BLOCK):
  return StepSpec(models=TrainModels.create(config, lora), schedule=Schedule(), optim=OptimSpec(),
                  block_size=block, micro_batches=micro)


def test_gradient_accumulation_equals_the_whole_batch():
  config = TINY_DREAM
  _, frozen, trainable, _, _ = _setup(config)
  batch = {"tokens": random_tokens(config, 4, 16, seed=5), "prompt_len": jnp.array([2, 7, 0, 4], jnp.int32)}
  key = jax.random.PRNGKey(9)
  g1, s1 = jax.jit(lambda t: loss_and_grads(_spec(config, LORA, 1), t, frozen, batch, key))(trainable)
  g2, s2 = jax.jit(lambda t: loss_and_grads(_spec(config, LORA, 2), t, frozen, batch, key))(trainable)
  np.testing.assert_allclose(float(s1["ce"]), float(s2["ce"]), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):  # equal up to summation order
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6 * float(np.abs(a).max()))
  assert set(g1["layers"]) == {f"{t}_lora_{ab}" for t in LORA.targets for ab in "ab"}, "only the adapter trains"


def test_full_finetune_student_starts_as_the_teacher():
  """Full fine-tune: the student is a copy of the teacher, so any loss gap is the attention pattern alone."""
  config = TINY_LLADA
  model = random_model(config, None, seed=3)
  frozen = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  # No prompt and one block per row: the block-causal student sees what the bidirectional teacher sees.
  spec = _spec(config, None, 1, block=16)
  batch = {"tokens": random_tokens(config, 2, 16), "prompt_len": jnp.zeros((2,), jnp.int32)}
  grads, sums = jax.jit(lambda t: loss_and_grads(spec, t, frozen, batch, jax.random.PRNGKey(0)))(frozen)
  assert set(grads) == set(frozen), "full fine-tune trains every parameter"
  assert float(sums["masked"]) > 0
  assert abs(float(sums["kl"])) < 1e-5 * float(sums["masked"])
  assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads)) < 1e-4  # at the optimum already
