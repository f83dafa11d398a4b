"""Every directory d2f_jax writes carries a README.md model card: converted directories (with their orbax tree),
exported Hugging Face checkpoints and PEFT adapters (library_name peft, base_model), so it says what it is."""

import numpy as np

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
  assert "| `params/layers/q` | [2, 64, 8, 16] |" in card and "| `params/embedding` | [512, 64] |" in card
  assert "No LoRA adapter" in card

  exported = convert.export_converted(converted, tmp_path / "hf_again", progress=False)["hf"]
  card = (tmp_path / "hf_again" / "README.md").read_text()
  assert _front_matter(card)["library_name"] == "d2f_jax" and "model_type 'Dream'" in card
  assert exported

  shapes = convert.lora_shapes(TINY_DREAM, lora)
  rng = np.random.default_rng(0)
  params = {"layers": {p.split("/")[1]: rng.normal(size=s).astype(np.float32) for p, s in shapes.items()}}
  convert.export_peft_adapter(tmp_path / "adapter", TINY_DREAM, lora, params, base_model_name_or_path="org/base")
  card = (tmp_path / "adapter" / "README.md").read_text()
  assert _front_matter(card) == {"library_name": "peft", "base_model": "org/base", "tags": ["d2f", "lora", "dream"]}
  assert "rank 4, alpha 8.0 (scale alpha / r), on q, v" in card
  assert peft_names("dream", "q", 0)[0].startswith("base_model.model.")  # the adapter itself is unchanged PEFT
