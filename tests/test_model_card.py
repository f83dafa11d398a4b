"""Every directory d2f_jax writes carries a README.md model card: converted directories (with their orbax tree),
exported Hugging Face checkpoints and PEFT adapters (library_name peft, base_model), so it says what it is."""

import numpy as np
import pytest

from d2f_jax import convert
from d2f_jax.convert import synthetic
from d2f_jax.convert.lora import peft_names
from d2f_jax.models import TINY_DREAM, LoraConfig


def _front_matter(text: str) -> dict:
  head = text.split("---\n")[1]
  fields, key = {}, None
  for line in head.splitlines():
    if line.startswith("- "):
      fields[key].append(line[2:])
    else:
      key, _, value = line.partition(": ")
      key = key.rstrip(":")
      fields[key] = value if value else []
  return fields


def test_converted_exported_and_adapter_directories_carry_cards(tmp_path):
  hf = synthetic.write_hf_checkpoint(tmp_path / "hf", TINY_DREAM, seed=0, dtype="float32")
  lora = LoraConfig(rank=4, alpha=8.0, targets=("q", "v"))
  converted = convert.convert_hf_dir(hf, tmp_path / "converted", progress=False)
  card = (tmp_path / "converted" / "README.md").read_text()
  assert _front_matter(card) == {"library_name": "d2f_jax", "base_model": str(hf),
                                 "tags": ["d2f", "dream", "orbax"]}
  assert "| `params/layers/q` | [2, 64, 128] |" in card and "| `params/embedding` | [512, 64] |" in card
  assert "No LoRA adapter" in card

  exported = convert.export_converted(converted, tmp_path / "hf_again", progress=False)["hf"]
  card = (tmp_path / "hf_again" / "README.md").read_text()
  assert _front_matter(card)["library_name"] == "d2f_jax" and "model_type 'Dream'" in card
  assert _front_matter(card)["base_model"] == str(hf)  # the checkpoint it came from, not a tokenizer directory
  assert exported

  shapes = convert.lora_shapes(TINY_DREAM, lora)
  rng = np.random.default_rng(0)
  params = {"layers": {p.split("/")[1]: rng.normal(size=s).astype(np.float32) for p, s in shapes.items()}}
  convert.export_peft_adapter(tmp_path / "adapter", TINY_DREAM, lora, params, base_model_name_or_path="org/base")
  card = (tmp_path / "adapter" / "README.md").read_text()
  assert _front_matter(card) == {"library_name": "peft", "base_model": "org/base", "tags": ["d2f", "lora", "dream"]}
  assert "rank 4, alpha 8.0 (scale alpha / r), on q, v" in card
  assert peft_names("dream", "q", 0)[0].startswith("base_model.model.")  # the adapter itself is unchanged PEFT


def test_an_exported_students_card_says_what_is_true(tmp_path):
  """A D2F student's card says block-causal as its config.json does, names the base it was trained from, and
  claims only the transformers loading that works: the Dream layout loads into Qwen2ForCausalLM."""
  import json

  hf = synthetic.write_hf_checkpoint(tmp_path / "base", TINY_DREAM, seed=0, dtype="float32")
  converted = convert.convert_hf_dir(hf, tmp_path / "converted", progress=False)
  _, params, _, _ = convert.load_params(converted)
  out = tmp_path / "student"
  convert.export_hf(out, TINY_DREAM, params, hf_config_json=str(tmp_path / "base" / "config.json"), aux_dir=hf,
                    base_model="org/dream-base", attention="block_causal")
  card = (out / "README.md").read_text()
  hf_cfg = json.loads((out / "config.json").read_text())
  assert hf_cfg["d2f_attention"] == "block_causal"
  assert "block-causally" in card and "bidirectional" not in card
  assert _front_matter(card)["base_model"] == "org/dream-base"
  assert "Qwen2ForCausalLM" in card and "not shipped" in card and "family's own" not in card

  transformers = pytest.importorskip("transformers")
  pytest.importorskip("torch")
  qwen2 = transformers.Qwen2Config(
      vocab_size=hf_cfg["vocab_size"], hidden_size=hf_cfg["hidden_size"], intermediate_size=hf_cfg["intermediate_size"],
      num_hidden_layers=hf_cfg["num_hidden_layers"], num_attention_heads=hf_cfg["num_attention_heads"],
      num_key_value_heads=hf_cfg["num_key_value_heads"], rope_theta=hf_cfg["rope_theta"],
      rms_norm_eps=hf_cfg["rms_norm_eps"], tie_word_embeddings=False,
      head_dim=hf_cfg.get("head_dim", hf_cfg["hidden_size"] // hf_cfg["num_attention_heads"]))
  _, info = transformers.Qwen2ForCausalLM.from_pretrained(str(out), config=qwen2, output_loading_info=True)
  assert not info["missing_keys"] and not info["unexpected_keys"], info
