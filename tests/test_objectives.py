"""The one Trainer's three objectives: mdm and ar losses against numpy, learning on a counting task, exact
resume, export of a randomly initialised model, and distillation from an mdm-trained base."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import d2f_jax
from d2f_jax.convert.synthetic import write_tokenizer
from d2f_jax.models import LLADA_8B, TINY_DREAM, TINY_LLADA, LoraConfig, align_logits, attention_ids
from d2f_jax.train import config as config_lib
from d2f_jax.train.loss_ar import ar_sums, target_mask
from d2f_jax.train.loss_mdm import mdm_sums, noise_mdm
from d2f_jax.train.metrics import forward_flops_per_token, train_flops_per_token
from d2f_jax.train.model import TrainModels, model_config
from d2f_jax.train.optim import OptimSpec
from d2f_jax.train.schedule import Schedule
from d2f_jax.train.step import StepSpec, loss_and_grads
from d2f_jax.train.trainer import Trainer
from model_utils import random_model, random_tokens

# --- losses against numpy ----------------------------------------------------------------------------------


def _log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _batch(config, length=16):
  """Three rows with EOS padding from different columns, prompts of 3, 5 and 0 tokens."""
  tokens = np.array(random_tokens(config, 3, length, seed=4))
  for row, eos_at in enumerate((9, 12, 6)):
    tokens[row, eos_at:] = config.eos_token_id
  return jnp.asarray(tokens), jnp.array([3, 5, 0], jnp.int32)


@pytest.mark.parametrize("config", [TINY_LLADA, TINY_DREAM], ids=["llada", "dream"])
def test_mdm_loss_equals_numpy(config):
  model = random_model(config, seed=1)
  tokens, prompt_len = _batch(config)
  batch, length = tokens.shape
  key, eps = jax.random.PRNGKey(7), 0.3
  noised = noise_mdm(key, tokens, prompt_len, eps=eps, mask_token_id=config.mask_token_id)
  # The mask, redrawn independently: t = eps + (1 - eps) u per row, a response position is masked iff u' < t.
  t_key, mask_key = jax.random.split(key)
  t = eps + (1 - eps) * np.asarray(jax.random.uniform(t_key, (batch,)), np.float64)
  u = np.asarray(jax.random.uniform(mask_key, (batch, length)))
  response = np.arange(length)[None] >= np.asarray(prompt_len)[:, None]
  masked = response & (u < t[:, None].astype(np.float32))
  np.testing.assert_array_equal(np.asarray(noised.masked), masked)
  assert masked.any() and not masked[~response].any(), "masks fall on the response only"
  np.testing.assert_allclose(np.asarray(noised.weight)[masked], np.broadcast_to(1 / t[:, None], masked.shape)[masked],
                             rtol=1e-6)
  noisy = np.where(masked, config.mask_token_id, np.asarray(tokens))
  np.testing.assert_array_equal(np.asarray(noised.tokens), noisy)

  positions = jnp.broadcast_to(jnp.arange(length), (batch, length))
  logits = np.asarray(model(jnp.asarray(noisy), positions, jnp.zeros((batch, length), jnp.int32))[0], np.float64)
  if config.logit_shift:  # Dream: row i predicts token i from output i - 1; row 0 keeps its own
    logits = np.concatenate([logits[:, :1], logits[:, :-1]], 1)
  ce = -np.take_along_axis(_log_softmax(logits), np.asarray(tokens)[..., None], -1)[..., 0]
  expected = (ce / t[:, None])[masked].sum() / response.sum()
  for chunk in (0, 4):
    sums = jax.jit(lambda n, chunk=chunk: mdm_sums(model, n, chunk=chunk))(noised)
    assert float(sums["response"]) == response.sum() and float(sums["masked"]) == masked.sum()
    np.testing.assert_allclose(float(sums["ce"]) / float(sums["response"]), expected, rtol=1e-5)


def test_mdm_semi_ar_rows_are_a_semi_ar_decodes_states():
  """semi_ar=1: every row is clean before its cut, masked with probability t over `window` positions from
  it and masked after; weights 1/t in the window, 1 after. semi_ar=0 draws exactly the iid masks."""
  config, eps, window = TINY_DREAM, 1e-3, 4
  tokens, prompt_len = _batch(config, length=32)
  key = jax.random.PRNGKey(3)
  plain = noise_mdm(key, tokens, prompt_len, eps=eps, mask_token_id=config.mask_token_id)
  same = noise_mdm(key, tokens, prompt_len, eps=eps, mask_token_id=config.mask_token_id, semi_ar=0.0, window=window)
  np.testing.assert_array_equal(np.asarray(plain.masked), np.asarray(same.masked))
  seen_window = False
  for seed in range(6):
    noised = noise_mdm(jax.random.PRNGKey(seed), tokens, prompt_len, eps=eps, mask_token_id=config.mask_token_id,
                       semi_ar=1.0, window=window)
    masked, weight, t = np.asarray(noised.masked), np.asarray(noised.weight), np.asarray(noised.t)
    for row in range(3):
      start = int(prompt_len[row])
      hits = np.flatnonzero(masked[row])
      assert hits.size and hits.min() >= start, "some response position is masked, no prompt position"
      # The cut: no masked position before it, every position from cut + window on masked.
      tail = np.flatnonzero(~masked[row])
      after = tail.max() + 1 if tail.size else 0  # all masked from here on
      assert not masked[row, :hits.min()].any() and masked[row, max(after, start):].all()
      assert after - hits.min() <= window, "the partly masked stretch is at most the window"
      window_hits = [j for j in hits if j < after] if after > hits.min() else []
      seen_window |= bool(window_hits)
      np.testing.assert_allclose(weight[row, window_hits], 1 / t[row], rtol=1e-6)
      np.testing.assert_allclose(weight[row, hits[hits >= max(after, hits.min() + window)]], 1.0)
  assert seen_window, "some row's window was partly masked"


def test_mdm_suffix_weight_scales_only_the_suffix_after_the_window():
  """suffix_weight=0 keeps the masks (same key) and the window's 1/t weights; the all-masked suffix after the
  window weighs 0 (in the loss: absent); iid rows (semi_ar=0) are untouched by it."""
  config, eps, window = TINY_DREAM, 1e-3, 4
  tokens, prompt_len = _batch(config, length=32)
  kw = dict(eps=eps, mask_token_id=config.mask_token_id, window=window)
  for seed in range(4):
    key = jax.random.PRNGKey(seed)
    full = noise_mdm(key, tokens, prompt_len, semi_ar=1.0, **kw)
    window_only = noise_mdm(key, tokens, prompt_len, semi_ar=1.0, suffix_weight=0.0, **kw)
    np.testing.assert_array_equal(np.asarray(full.masked), np.asarray(window_only.masked))
    w_full, w_window = np.asarray(full.weight), np.asarray(window_only.weight)
    kept = w_window > 0
    np.testing.assert_array_equal(w_window[kept], w_full[kept])
    dropped = np.asarray(full.masked) & ~kept  # the suffix: weight 1 before, 0 now, and it is not empty
    assert dropped.any() and np.all(w_full[dropped] == 1.0)
    for row in range(3):  # every dropped position lies after every kept one in its row
      if kept[row].any() and dropped[row].any():
        assert np.flatnonzero(dropped[row]).min() > np.flatnonzero(kept[row]).max()
    iid = noise_mdm(key, tokens, prompt_len, semi_ar=0.0, suffix_weight=0.0, **kw)
    np.testing.assert_array_equal(np.asarray(iid.weight), np.asarray(noise_mdm(key, tokens, prompt_len, **kw).weight))


@pytest.mark.parametrize("config", [TINY_LLADA, TINY_DREAM], ids=["llada", "dream"])
def test_ar_loss_equals_numpy(config):
  model = random_model(config, seed=2)
  tokens, prompt_len = _batch(config)
  tokens = tokens.at[0, 1].set(config.eos_token_id)  # an EOS inside the prompt does not end the response
  batch, length = tokens.shape
  toks, pl = np.asarray(tokens), np.asarray(prompt_len)
  want = np.zeros((batch, length), bool)  # token j is a target for prompt_len <= j <= first EOS after it
  for row in range(batch):
    start = max(pl[row], 1)
    eos = [j for j in range(start, length) if toks[row, j] == config.eos_token_id]
    want[row, start:(eos[0] + 1 if eos else length)] = True
  targets = target_mask(tokens, prompt_len, config.eos_token_id)
  np.testing.assert_array_equal(np.asarray(targets), want)
  assert want[0, 9] and not want[0, 10:].any() and not want[0, :3].any(), "first EOS counts, later padding not"

  positions = jnp.broadcast_to(jnp.arange(length), (batch, length))
  logits = np.asarray(model(tokens, positions, positions)[0], np.float64)  # causal: id = position; raw logits
  logp = _log_softmax(logits)
  ce = -np.take_along_axis(logp[:, :-1], toks[:, 1:, None], -1)[..., 0]  # row i predicts token i + 1
  expected = ce[want[:, 1:]].mean()
  for chunk in (0, 8):
    sums = jax.jit(lambda t, m, chunk=chunk: ar_sums(model, t, m, chunk=chunk))(tokens, targets)
    assert float(sums["targets"]) == want.sum()
    np.testing.assert_allclose(float(sums["ce"]) / float(sums["targets"]), expected, rtol=1e-5)


@pytest.mark.parametrize("objective", ["mdm", "ar"])
def test_gradient_accumulation_equals_the_whole_batch(objective):
  config = TINY_DREAM.replace(num_layers=1)
  params = nnx.to_pure_dict(nnx.state(random_model(config, seed=3), nnx.Param))
  tokens, prompt_len = _batch(config)
  batch = {"tokens": jnp.concatenate([tokens, tokens[:1]]), "prompt_len": jnp.concatenate([prompt_len, prompt_len[:1]])}
  models = TrainModels.create(config, None, teacher=False)
  out = []
  for micro in (1, 2):
    spec = StepSpec(models, Schedule(), OptimSpec(), block_size=4, micro_batches=micro, objective=objective)
    out.append(jax.jit(lambda p, spec=spec: loss_and_grads(spec, p, {}, batch, jax.random.PRNGKey(5)))(params))
  (g1, s1), (g2, s2) = out
  assert s1.keys() == s2.keys() and float(s1["ce"]) > 0
  for k in s1:
    np.testing.assert_allclose(float(s1[k]), float(s2[k]), rtol=1e-6, err_msg=k)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6 * float(np.abs(a).max()))


def test_flops_count_no_teacher_outside_distillation():
  fwd, lora = forward_flops_per_token(LLADA_8B, 1024), LoraConfig()
  assert train_flops_per_token(LLADA_8B, 1024, None, teacher=False) == 3 * fwd
  assert train_flops_per_token(LLADA_8B, 1024, lora, teacher=False) == pytest.approx(
      2 * forward_flops_per_token(LLADA_8B, 1024, lora))


# --- the Trainer on a counting task ---------------------------------------------------------------------------

SEQ, VOCAB = 16, 32
IDS = dict(mask_token_id=31, eos_token_id=30, pad_token_id=30, bos_token_id=29, eot_token_id=28)
MICRO = dict(vocab_size=VOCAB, embed_dim=32, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=16, mlp_dim=64,
             **IDS)
STEPS = 30


@pytest.fixture(scope="module")
def count_task(tmp_path_factory):
  """npz rows 'prompt of p = 3..6 random words | p words counting on from the last one | EOS padding' and a
  tokenizer directory: the response is a function of the prompt that a 2-layer model learns in seconds."""
  root = tmp_path_factory.mktemp("count")
  rng = np.random.default_rng(0)
  n = 144
  tokens = np.full((n, SEQ), IDS["eos_token_id"], np.int32)
  prompt_len = rng.integers(3, 7, size=n).astype(np.int32)
  for i, p in enumerate(prompt_len):
    words = rng.integers(0, 24, size=p)
    tokens[i, :2 * p] = np.concatenate([words, (words[-1] + 1 + np.arange(p)) % 24])
  path = str(root / "rows.npz")
  np.savez(path, tokens=tokens, prompt_len=prompt_len)
  tok_dir = root / "tokenizer"
  tok_dir.mkdir()
  write_tokenizer(str(tok_dir), TINY_LLADA.replace(vocab_size=VOCAB, **IDS))
  return path, str(tok_dir)


def micro_config(objective, count_task, **overrides):
  path, tok_dir = count_task
  c = config_lib.base_config()
  c.objective = objective
  c.model.init = "random"
  c.model.preset = "tiny-llada"
  c.model.overrides = dict(MICRO)
  c.model.dtype = "float32"
  c.finetune = "full"
  c.data.update(dict(source="npz", path=path, tokenizer=tok_dir, seq_len=SEQ, eval_examples=16))
  c.block_size = 4
  c.batch_size = 8
  c.total_steps = STEPS
  c.optim.update(dict(lr=1e-2, warmup_steps=3))
  c.mesh.update(dict(data=1, fsdp=-1, tensor=1))
  c.checkpoint.update(dict(every=2, keep=2))
  c.log_every, c.eval_every, c.eval_batches = 1, 1000, 2
  c.peak_flops = 1e12  # no CPU matmul measurement
  c.progress_bar = False
  c.update_from_flattened_dict(overrides)
  return c


def _train(config, workdir):
  trainer = Trainer(config, workdir)
  history = trainer.run()
  trainer.close()
  return trainer, history


@pytest.fixture(scope="module")
def mdm_run(count_task, tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("mdm"))
  return (*_train(micro_config("mdm", count_task), workdir), workdir)


@pytest.mark.parametrize("objective", ["mdm", "ar"])
def test_training_lowers_held_out_loss(objective, count_task, mdm_run, tmp_path):
  trainer, history, _ = mdm_run if objective == "mdm" else (*_train(micro_config("ar", count_task), str(tmp_path)),
                                                            None)
  before, after = history[0], history[-1]
  assert (before["step"], after["step"]) == (0, STEPS)
  assert after["eval_loss"] < 0.5 * before["eval_loss"], (before, after)
  assert after["eval_accuracy"] > before["eval_accuracy"] + 0.3, (before, after)
  assert all(np.isfinite(h["loss"]) and 0 < h["mfu"] for h in history[1:])
  assert trainer.frozen == {}, "no frozen copy beside a full fine-tune without a teacher"
  if objective == "mdm":
    assert 0 < before["eval_mask_rate"] == after["eval_mask_rate"] < 1, "held-out batches are noised identically"


def test_mdm_resumes_with_the_same_losses(count_task, mdm_run, tmp_path):
  _, history, _ = mdm_run
  expected = {h["step"]: h["loss"] for h in history if "loss" in h}
  config, workdir = micro_config("mdm", count_task), str(tmp_path)
  first = Trainer(config, workdir)
  first.run(num_steps=3)  # "killed" after step 3: the last checkpoint is step 2
  first.close()
  second = Trainer(config, workdir)
  assert second.step == 2
  got = {h["step"]: h["loss"] for h in second.run(num_steps=3)}
  second.close()
  assert sorted(got) == [3, 4, 5]
  for step, loss in got.items():
    np.testing.assert_allclose(loss, expected[step], rtol=1e-6, err_msg=f"step {step}")


def test_random_init_exports_a_llada_checkpoint_with_the_trained_logits(mdm_run):
  trainer, _, workdir = mdm_run
  hf = os.path.join(workdir, "hf")
  with open(os.path.join(hf, "config.json")) as f:
    assert json.load(f)["model_type"] == "llada"
  exported = d2f_jax.load_model(hf)
  assert exported.tokenizer is not None, "data.tokenizer is copied along"
  assert exported.config.mask_token_id == IDS["mask_token_id"] and exported.config.eot_token_id == IDS["eot_token_id"]
  tokens = jnp.asarray(trainer.eval_data[0]["tokens"])
  positions = jnp.broadcast_to(jnp.arange(SEQ), tokens.shape)
  model = trainer.model()
  ours = align_logits(model(tokens, positions, attention_ids(positions, "bidirectional"))[0], model.config)
  np.testing.assert_allclose(np.asarray(exported.logits(tokens)), np.asarray(ours), rtol=1e-5, atol=1e-5)


def test_distillation_starts_from_an_mdm_trained_base(count_task, mdm_run, tmp_path):
  _, _, workdir = mdm_run
  config = micro_config("distill", count_task, **{
      "model.init": "path", "model.path": os.path.join(workdir, "hf"), "model.preset": None, "model.overrides": {},
      "data.tokenizer": None, "finetune": "lora", "total_steps": 6, "checkpoint.every": 6, "optim.lr": 1e-3})
  config.lora.update(dict(rank=4, alpha=8.0, dropout=0.0))
  trainer, history = _train(config, str(tmp_path))
  before, after = history[0], history[-1]
  assert after["step"] == 6 and all(np.isfinite(h["loss"]) for h in history[1:])
  assert after["eval_kl"] < before["eval_kl"], (before, after)
  assert os.path.isfile(os.path.join(trainer.workdir, "adapter", "adapter_config.json"))


@pytest.mark.parametrize("field,value,match", [
    ("objective", "dpo", "config.objective"), ("model.init", "hf", "config.model.init"),
    ("finetune", "lora", "config.finetune"), ("mdm.eps", 0.0, "config.mdm.eps"),
    ("model.path", "/ckpt", "config.model.path")])
def test_bad_objective_fields_are_named(count_task, field, value, match):
  config = micro_config("mdm", count_task)
  config.update_from_flattened_dict({field: value})
  with pytest.raises(ValueError, match=match):
    config_lib.validate(config)


@pytest.mark.parametrize("arg", ["objective=mdm,random", "objective=ar", "family=dream,objective=mdm,random"])
def test_tiny_config_objectives_validate(arg):
  c = config_lib.load_config_file(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                               "configs", f"tiny.py:{arg}"))
  config_lib.validate(c)
  assert c.finetune == "full" and c.objective in ("mdm", "ar")


def test_model_config_from_preset_overrides_and_remat(count_task):
  c = micro_config("mdm", count_task, remat=True)
  config = model_config(c.model, remat=c.remat)
  assert (config.vocab_size, config.embed_dim, config.family, config.mask_token_id) == (VOCAB, 32, "llada", 31)
  assert getattr(config, "remat", True), "config.remat reaches ModelConfig.remat (when the field exists)"
  c.model.preset = None  # overrides alone must name every shape field
  c.model.overrides = {"vocab_size": VOCAB}
  with pytest.raises(ValueError, match="config.model.overrides"):
    model_config(c.model)
