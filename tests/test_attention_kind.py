"""How a model attends is part of its config (ModelConfig.attention_kind), written by convert and the trainer's
exports, read by every loader, and checked by `decode.generate` itself: 'ar' on a converted bidirectional
model used to decode garbage, because only the CLIs looked, and only at a Hugging Face config.json."""

import json
import os

import pytest

import d2f_jax
from d2f_jax import convert
from d2f_jax.convert import synthetic
from d2f_jax.decode import DecodeConfig, generate
from d2f_jax.models import TINY_LLADA

CONFIG = TINY_LLADA.replace(num_layers=1)
PROMPT = [[5, 6, 7]]


def _hf(tmp_path, attention=None):
  path = tmp_path / f"hf_{attention}"
  synthetic.write_hf_checkpoint(path, CONFIG, seed=0, dtype="float32")
  if attention:
    raw = json.loads((path / "config.json").read_text())
    raw["d2f_attention"] = attention
    (path / "config.json").write_text(json.dumps(raw))
  return path


def test_generate_refuses_ar_on_a_converted_bidirectional_model(tmp_path):
  out = tmp_path / "converted"
  convert.convert_hf_dir(_hf(tmp_path), out, progress=False)
  meta = json.loads((out / "d2f_model.json").read_text())
  assert meta["config"]["attention_kind"] == "bidirectional"
  model = d2f_jax.load_model(str(out))
  with pytest.raises(ValueError, match=r"method='ar' needs a causal model, but this model attends bidirectional"):
    generate(model, PROMPT, DecodeConfig(method="ar", max_new_tokens=4, block_size=4))
  generate(model, PROMPT, DecodeConfig(method="d2f", max_new_tokens=4, block_size=4))  # what it is for


def test_a_causal_models_kind_survives_convert_and_refuses_diffusion_methods(tmp_path):
  out = tmp_path / "converted"
  convert.convert_hf_dir(_hf(tmp_path, "causal"), out, progress=False)
  model = d2f_jax.load_model(str(out))
  assert model.config.attention_kind == "causal"
  with pytest.raises(ValueError, match=r"method='d2f' needs a masked-diffusion .* trained causally"):
    generate(model, PROMPT, DecodeConfig(method="d2f", max_new_tokens=4, block_size=4))
  generate(model, PROMPT, DecodeConfig(method="ar", max_new_tokens=4, block_size=1))
  back = tmp_path / "back"
  convert.export_converted(out, back)
  assert json.loads((back / "config.json").read_text())["d2f_attention"] == "causal"


def test_a_converted_directory_from_before_the_field_takes_it_from_its_config_json(tmp_path):
  out = tmp_path / "converted"
  convert.convert_hf_dir(_hf(tmp_path), out, progress=False)
  meta = json.loads((out / "d2f_model.json").read_text())
  del meta["config"]["attention_kind"]
  (out / "d2f_model.json").write_text(json.dumps(meta))
  assert d2f_jax.load_model(str(out)).config.attention_kind == "bidirectional"


def test_the_trainers_export_records_the_objectives_attention(tmp_path):
  from d2f_jax.train.trainer import Trainer
  from test_robust_train import tiny_config
  trainer = Trainer(tiny_config(objective="ar", finetune="full", export=True), str(tmp_path / "work"))
  try:
    exported = trainer.export()
  finally:
    trainer.close()
  assert json.loads(open(os.path.join(exported, "config.json")).read())["d2f_attention"] == "causal"
  assert d2f_jax.load_model(exported).config.attention_kind == "causal"
