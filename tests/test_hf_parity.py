"""Our converted models against transformers' Llama (LLaDA) and Qwen2 (Dream), same weights, fp32.

The checkpoints are written in the real LLaDA / Dream formats; the reference reads the same safetensors
through its own, independent renaming into Llama / Qwen2 names.
"""

import json

import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file

import d2f_jax
from d2f_jax.convert import synthetic
from d2f_jax.models import TINY_DREAM, TINY_LLADA

TOL = dict(rtol=1e-4, atol=1e-4)
PROMPT_LEN = 224


def _llada_to_llama_name(name: str) -> str:
  name = name.replace("model.transformer.wte.", "model.embed_tokens.")
  name = name.replace("model.transformer.ln_f.", "model.norm.")
  name = name.replace("model.transformer.ff_out.", "lm_head.")
  name = name.replace("model.transformer.blocks.", "model.layers.")
  for ours, theirs in {"attn_norm": "input_layernorm", "ff_norm": "post_attention_layernorm",
                       "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
                       "attn_out": "self_attn.o_proj", "ff_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
                       "ff_out": "mlp.down_proj"}.items():
    name = name.replace(f".{ours}.", f".{theirs}.")
  return name


def _read_tensors(hf_dir) -> dict[str, np.ndarray]:
  tensors = {}
  for path in sorted(hf_dir.glob("*.safetensors")):
    tensors.update(load_file(str(path)))
  return tensors


def reference_model(hf_dir, family: str):
  """transformers' Llama / Qwen2 holding the checkpoint's weights."""
  cfg = json.loads((hf_dir / "config.json").read_text())
  if family == "llada":
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg["embedding_size"], hidden_size=cfg["d_model"], intermediate_size=cfg["mlp_hidden_size"],
        num_hidden_layers=cfg["n_layers"], num_attention_heads=cfg["n_heads"], num_key_value_heads=cfg["n_kv_heads"],
        rope_theta=cfg["rope_theta"], rms_norm_eps=cfg["rms_norm_eps"], tie_word_embeddings=False,
        attention_bias=False, mlp_bias=False)
    rename = _llada_to_llama_name
    model_cls = transformers.LlamaForCausalLM
  else:
    hf_cfg = transformers.Qwen2Config(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"], rope_theta=cfg["rope_theta"], rms_norm_eps=cfg["rms_norm_eps"],
        tie_word_embeddings=False, use_sliding_window=False,
        head_dim=cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"]))
    rename = lambda name: name  # Dream already uses Qwen2 names.
    model_cls = transformers.Qwen2ForCausalLM
  hf_cfg._attn_implementation = "eager"
  model = model_cls(hf_cfg).eval().to(torch.float32)
  state = {rename(k): torch.from_numpy(np.asarray(v, np.float32)) for k, v in _read_tensors(hf_dir).items()}
  missing, unexpected = model.load_state_dict(state, strict=False)
  assert not unexpected, unexpected
  assert not [m for m in missing if "rotary" not in m], missing
  return model


def _batch(config, pad: int, seed: int):
  """Two rows: the first left-padded by `pad`, the second full length."""
  rng = np.random.default_rng(seed)
  high = min(config.mask_token_id, config.eos_token_id)
  tokens = rng.integers(0, high, size=(2, PROMPT_LEN)).astype(np.int64)
  mask = np.ones_like(tokens)
  tokens[0, :pad] = config.pad_token_id
  mask[0, :pad] = 0
  return tokens, mask


def _hf_logits(model, tokens, mask, causal: bool) -> np.ndarray:
  positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
  with torch.no_grad():
    out = model(input_ids=torch.from_numpy(tokens), attention_mask=torch.from_numpy(mask),
                position_ids=torch.from_numpy(positions), is_causal=causal)
  return out.logits.float().numpy()


@pytest.fixture(scope="module", params=["llada", "dream"])
def checkpoint(request, tmp_path_factory):
  family = request.param
  config = TINY_LLADA if family == "llada" else TINY_DREAM
  hf_dir = tmp_path_factory.mktemp(f"hf_{family}")
  synthetic.write_hf_checkpoint(hf_dir, config, seed=7, dtype="float32", shards=2)
  return family, config, hf_dir, reference_model(hf_dir, family), d2f_jax.load_model(str(hf_dir))


@pytest.mark.parametrize("pad", [0, 37])
@pytest.mark.parametrize("mode", ["bidirectional", "causal"])
def test_logits_match_transformers(checkpoint, pad, mode):
  family, config, _, reference, ours = checkpoint
  tokens, mask = _batch(config, pad, seed=pad)
  expected = _hf_logits(reference, tokens, mask, causal=(mode == "causal"))
  got = np.asarray(ours.logits(tokens, attention_mask=mask, mode=mode, align=False))
  valid = mask.astype(bool)
  assert got.shape == expected.shape
  np.testing.assert_allclose(got[valid], expected[valid], **TOL)
  # A wrong attention pattern must not pass: bidirectional and causal really differ here.
  other = _hf_logits(reference, tokens, mask, causal=(mode != "causal"))
  assert np.abs(other[valid] - got[valid]).max() > 1e-2


def test_dream_alignment_shifts_rows(checkpoint):
  family, config, _, _, ours = checkpoint
  tokens, mask = _batch(config, 0, seed=1)
  raw = np.asarray(ours.logits(tokens, attention_mask=mask, align=False))
  aligned = np.asarray(ours.logits(tokens, attention_mask=mask, align=True))
  if family == "dream":
    np.testing.assert_array_equal(aligned[:, 1:], raw[:, :-1])
    np.testing.assert_array_equal(aligned[:, 0], raw[:, 0])
  else:
    np.testing.assert_array_equal(aligned, raw)
