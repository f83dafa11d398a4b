"""`d2f_jax.load_model`: both directory kinds, LoRA merged vs separate, tokenizer, clear errors."""

import jax
import numpy as np
import pytest
import tokenizers
import transformers

import d2f_jax
from d2f_jax import convert
from d2f_jax.convert import synthetic
from d2f_jax.models import TINY_DREAM, TINY_LLADA, LoraConfig

TOL = dict(rtol=1e-4, atol=1e-4)


def _tokens(config, length=40, seed=0):
  rng = np.random.default_rng(seed)
  return rng.integers(0, config.mask_token_id, size=(2, length)).astype(np.int32)


def _write_tokenizer(directory, config):
  """A word-level tokenizer with the family's special tokens at their ids, saved the HF way."""
  vocab = {f"w{i}": i for i in range(config.vocab_size)}
  special = {"<mask>": config.mask_token_id, "<eos>": config.eos_token_id}
  for name, idx in special.items():
    vocab.pop(f"w{idx}")
    vocab[name] = idx
  model = tokenizers.models.WordLevel(vocab, unk_token="w0")
  tok = tokenizers.Tokenizer(model)
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", mask_token="<mask>",
                                              unk_token="w0")
  fast.save_pretrained(directory)


@pytest.mark.parametrize("config", [TINY_LLADA, TINY_DREAM], ids=["llada", "dream"])
def test_hf_dir_and_converted_dir_give_identical_logits(tmp_path, config):
  hf_dir = tmp_path / "hf"
  # Without the synthetic tokenizer's files: their special tokens, absent from this vocabulary, would be added
  # past the embedding (ids 512+), which load_model refuses.
  synthetic.write_hf_checkpoint(hf_dir, config, seed=3, dtype="float32", tokenizer=False)
  _write_tokenizer(hf_dir, config)
  from_hf = d2f_jax.load_model(hf_dir)
  out = tmp_path / "converted"
  convert.convert_hf_dir(hf_dir, out, progress=False)
  from_converted = d2f_jax.load_model(out)
  assert from_hf.config == from_converted.config
  tokens = _tokens(config)
  np.testing.assert_array_equal(np.asarray(from_hf.logits(tokens)), np.asarray(from_converted.logits(tokens)))
  # The tokenizer travels with the converted model.
  assert from_converted.encode("w5 w7 <eos>") == [5, 7, config.eos_token_id]
  assert from_converted.decode([5, 7]) == "w5 w7"


@pytest.mark.parametrize("config", [TINY_LLADA, TINY_DREAM], ids=["llada", "dream"])
def test_lora_merged_equals_lora_applied_separately(tmp_path, config):
  hf_dir, lora_dir = tmp_path / "hf", tmp_path / "lora"
  synthetic.write_hf_checkpoint(hf_dir, config, seed=1, dtype="float32")
  lora = LoraConfig(rank=4, alpha=8.0, targets=("q", "k", "v", "o"))
  synthetic.write_peft_adapter(lora_dir, config, lora, seed=2)
  merged = d2f_jax.load_model(hf_dir, lora_dir=lora_dir, merge_lora=True)
  separate = d2f_jax.load_model(hf_dir, lora_dir=lora_dir, merge_lora=False)
  base = d2f_jax.load_model(hf_dir)
  assert merged.lora is None and separate.lora is not None and separate.lora.rank == 4
  tokens = _tokens(config, seed=4)
  for mode in ("bidirectional", "block_causal"):
    kw = dict(prompt_len=10, block_size=8) if mode == "block_causal" else {}
    a = np.asarray(merged.logits(tokens, mode=mode, **kw))
    b = np.asarray(separate.logits(tokens, mode=mode, **kw))
    np.testing.assert_allclose(a, b, **TOL)
    assert np.abs(a - np.asarray(base.logits(tokens, mode=mode, **kw))).max() > 1e-3  # the adapter matters


def test_load_model_errors_name_the_problem(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    d2f_jax.load_model(tmp_path / "nowhere")
  (tmp_path / "empty").mkdir()
  with pytest.raises(FileNotFoundError, match="neither a converted model"):
    d2f_jax.load_model(tmp_path / "empty")
  hf_dir = tmp_path / "hf"
  synthetic.write_hf_checkpoint(hf_dir, TINY_LLADA, seed=0, dtype="float32", tokenizer=False)
  model = d2f_jax.load_model(hf_dir)
  with pytest.raises(ValueError, match="token ids must lie in"):
    model.logits(np.array([[TINY_LLADA.vocab_size]]))
  with pytest.raises(ValueError, match="attention_mask shape"):
    model.logits(np.zeros((1, 4), np.int32), attention_mask=np.ones((1, 5), np.int32))
  with pytest.raises(ValueError, match="no tokenizer"):
    model.encode("hello")


def test_dtype_argument_casts_weights(tmp_path):
  hf_dir = tmp_path / "hf"
  synthetic.write_hf_checkpoint(hf_dir, TINY_DREAM, seed=0, dtype="float32")
  model = d2f_jax.load_model(hf_dir, dtype="bfloat16")
  assert model.config.param_dtype == "bfloat16" and model.config.dtype == "bfloat16"
  dtypes = {leaf.dtype for leaf in jax.tree.leaves(model.state)}
  assert dtypes == {jax.numpy.dtype("bfloat16")}
  tokens = _tokens(TINY_DREAM)
  full = np.asarray(d2f_jax.load_model(hf_dir).logits(tokens))
  half = np.asarray(model.logits(tokens))
  np.testing.assert_allclose(half, full, atol=0.15)  # bf16 compute of a 2-layer model


def test_generate_text_is_the_id_level_decode_through_the_tokenizer(tmp_path):
  """model.generate(text) -> str equals decode.generate on the encoded ids, cut at the first stop token and
  decoded; a list of prompts decodes as one batch with each row's batch-1 text."""
  from d2f_jax.decode import DecodeConfig, generate
  hf_dir = tmp_path / "hf"
  synthetic.write_hf_checkpoint(hf_dir, TINY_DREAM, seed=3, dtype="float32")
  model = d2f_jax.load_model(hf_dir)
  settings = dict(block_size=4, max_new_tokens=8, tau_add=0.0, tau_act=0.0, tau_conf=0.0)
  prompts = ["w5 w7 w9", "w11 w3"]
  texts = model.generate(prompts, method="d2f", **settings)
  for prompt, text in zip(prompts, texts):
    ids = generate(model, [model.encode(prompt)], DecodeConfig(method="d2f", **settings)).to_lists()[0]
    assert ids, "the tiny model decoded nothing: the comparison would be empty"
    assert text == model.decode(ids) == model.generate(prompt, method="d2f", **settings)
  with pytest.raises(TypeError, match="string or a non-empty list"):
    model.generate([1, 2, 3])
  with pytest.raises(ValueError, match="block_size"):
    model.generate("w5", block_size=3, max_new_tokens=8)


def test_changing_the_module_leaves_the_handle_as_it_was():
  """Model.module is over fresh Variables: a frozen handle's weights cannot change behind its back."""
  from d2f_jax.api import Model
  from model_utils import random_model
  model = Model.from_module(random_model(TINY_LLADA, seed=0))
  before = np.asarray(model.state["lm_head"][...]).copy()
  module = model.module
  module.lm_head[...] = module.lm_head[...] * 4.0
  np.testing.assert_array_equal(np.asarray(model.state["lm_head"][...]), before)
  np.testing.assert_array_equal(np.asarray(Model.from_module(module).state["lm_head"][...]), before * 4.0)
