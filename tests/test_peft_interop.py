"""LoRA adapters interchange with the real `peft` library, both ways, on Dream (the Qwen2 layout that
transformers and peft know; LLaDA's modeling code is remote code, outside both).

An adapter saved by `peft` (random A and B, every projection, rsLoRA on and off) loads here and gives
peft's logits; the same adapter exported again by d2f_jax loads in `peft.PeftModel` and gives the same
logits, fp32 within 1e-4 (the tolerance of tests/test_hf_parity.py)."""

import json

import numpy as np
import pytest

peft = pytest.importorskip("peft")
torch = pytest.importorskip("torch")

import d2f_jax  # noqa: E402
from d2f_jax.convert import export_peft_adapter, synthetic  # noqa: E402
from d2f_jax.models import TINY_DREAM  # noqa: E402
from test_hf_parity import TOL, _batch, _hf_logits, reference_model  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
  hf_dir = tmp_path_factory.mktemp("dream_base")
  synthetic.write_hf_checkpoint(hf_dir, TINY_DREAM, seed=3, dtype="float32")
  return hf_dir


def _peft_model(hf_dir, adapter_dir=None, *, rslora=False, seed=0):
  model = reference_model(hf_dir, "dream")
  if adapter_dir is not None:
    return peft.PeftModel.from_pretrained(model, str(adapter_dir)).eval()
  torch.manual_seed(seed)
  config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0, use_rslora=rslora,
                           init_lora_weights=False)  # random A and B: an adapter that changes the logits
  return peft.get_peft_model(model, config).eval()


@pytest.mark.parametrize("rslora", [False, True])
def test_adapters_round_trip_through_peft(base, tmp_path, rslora):
  tokens, mask = _batch(TINY_DREAM, 13, seed=4)
  valid = mask.astype(bool)
  theirs = _peft_model(base, rslora=rslora)
  theirs.save_pretrained(str(tmp_path / "from_peft"))
  expected = _hf_logits(theirs, tokens, mask, causal=False)
  plain = _hf_logits(reference_model(base, "dream"), tokens, mask, causal=False)
  assert np.abs(expected[valid] - plain[valid]).max() > 1e-2  # the adapter matters

  # peft -> d2f_jax: separate LoRA parameters and merged weights both give peft's logits.
  for merge in (False, True):
    ours = d2f_jax.load_model(str(base), lora_dir=str(tmp_path / "from_peft"), merge_lora=merge)
    got = np.asarray(ours.logits(tokens, attention_mask=mask, mode="bidirectional", align=False))
    np.testing.assert_allclose(got[valid], expected[valid], **TOL)
  assert ours.lora is None and separate_lora(base, tmp_path / "from_peft").use_rslora == rslora

  # d2f_jax -> peft: the exported adapter is a PeftModel adapter with the same logits.
  kept = d2f_jax.load_model(str(base), lora_dir=str(tmp_path / "from_peft"), merge_lora=False)
  lora_state = {"layers": {k: np.asarray(v[...]) for k, v in kept.state["layers"].items() if "_lora_" in k}}
  export_peft_adapter(tmp_path / "from_d2f", kept.config, kept.lora, lora_state, base_model_name_or_path=str(base))
  saved = json.loads((tmp_path / "from_d2f" / "adapter_config.json").read_text())
  assert saved["peft_type"] == "LORA" and sorted(saved["target_modules"]) == sorted(TARGETS)
  again = _hf_logits(_peft_model(base, tmp_path / "from_d2f"), tokens, mask, causal=False)
  np.testing.assert_allclose(again[valid], expected[valid], **TOL)


def separate_lora(hf_dir, adapter_dir):
  return d2f_jax.load_model(str(hf_dir), lora_dir=str(adapter_dir), merge_lora=False).lora
