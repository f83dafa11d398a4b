"""README.md model cards for what d2f_jax writes: converted (orbax) directories, exported Hugging Face
checkpoints and PEFT adapters. A directory met on a shared disk or the Hub then says what it is, which base
it belongs to, which library reads it, and (converted) how its orbax tree is laid out."""

from __future__ import annotations

from d2f_jax.convert.hf_config import ATTENTION_KEY
from d2f_jax.convert.mapping import lora_shapes, param_shapes
from d2f_jax.models import LoraConfig, ModelConfig

CARD_FILE = "README.md"
# config.json key naming how a model was trained to attend: 'causal', 'bidirectional' or 'block_causal'
# (an extra key transformers ignores; decode.methods.check_method_fits refuses a method that does not fit it).
_READS = {"llada": "GSAI-ML/LLaDA-8B-Instruct (model_type 'llada')",
          "dream": "Dream-org/Dream-v0-Base-7B (model_type 'Dream')"}
_ATTENDS = {"bidirectional": "bidirectionally (a masked-diffusion model: every position sees every other)",
            "block_causal": "block-causally (a D2F student: a block sees itself and the blocks before it)",
            "causal": "causally (an autoregressive model)"}
# What transformers can really do with the files (tests/test_model_card.py loads the Dream layout; the LLaDA
# renaming is tests/test_hf_parity.py's): the families' own modeling code is remote code, not shipped here.
_TRANSFORMERS = {
    "dream": "The tensors carry Qwen2's names: `transformers.Qwen2ForCausalLM.from_pretrained(this_dir, "
             "config=Qwen2Config(...))`, with this config.json's sizes, `rope_theta` and `rms_norm_eps`, loads "
             "them (Qwen2 attends causally unless given another mask). `AutoModel` with `trust_remote_code=True` "
             "needs Dream's `configuration_dream.py` / `modeling_dream.py` (config.json `auto_map`), which are "
             "not shipped here: copy them from Dream-org/Dream-v0-Base-7B.",
    "llada": "The network is Llama's, but the tensors carry LLaDA's names (`model.transformer.blocks.N.q_proj`, "
             "...): `transformers.LlamaForCausalLM` computes the same logits only once they are renamed to "
             "Llama's. `AutoModel` with `trust_remote_code=True` needs LLaDA's `configuration_llada.py` / "
             "`modeling_llada.py` (config.json `auto_map`), which are not shipped here: copy them from "
             "GSAI-ML/LLaDA-8B-Instruct.",
}


def _front_matter(**fields) -> str:
  lines = ["---"]
  for key, value in fields.items():
    if value is None:
      continue
    if isinstance(value, (list, tuple)):
      lines.append(f"{key}:")
      lines += [f"- {v}" for v in value]
    else:
      lines.append(f"{key}: {value}")
  return "\n".join(lines + ["---", ""])


def _shape_line(config: ModelConfig) -> str:
  return (f"{config.num_layers} layers, width {config.embed_dim}, {config.num_heads} heads "
          f"({config.num_kv_heads} kv heads) of {config.head_dim}, MLP {config.mlp_dim}, vocabulary "
          f"{config.vocab_size}, weights in {config.param_dtype}")


def _lora_line(lora: LoraConfig) -> str:
  scale = "alpha / sqrt(r)" if lora.use_rslora else "alpha / r"
  return f"rank {lora.rank}, alpha {lora.alpha} (scale {scale}), on {', '.join(lora.targets)}"


def converted_card(config: ModelConfig, lora: LoraConfig | None, source: str | None) -> str:
  """The card of a converted directory: base, shapes and the orbax tree (paths and shapes)."""
  tree = "\n".join(f"| `params/{path}` | {list(shape)} |" for path, shape in param_shapes(config).items())
  if lora is not None:
    tree += "\n" + "\n".join(f"| `lora/{path}` | {list(shape)} |"
                             for path, shape in lora_shapes(config, lora).items())
  return "\n".join([
      _front_matter(library_name="d2f_jax", base_model=source, tags=["d2f", config.family, "orbax"]),
      f"# {config.family} converted for d2f_jax",
      "",
      f"A {config.family} model ({_shape_line(config)}) in d2f_jax's converted form: an orbax tree of numpy "
      "arrays, read with `d2f_jax.load_model(this_dir)` and written back to Hugging Face files with "
      "`python -m d2f_jax.convert --to_hf --converted this_dir --out DIR` (bit-identical).",
      "",
      f"Converted from: `{source}`." if source else "Converted from parameters in memory.",
      f"LoRA kept separate: {_lora_line(lora)}." if lora else "No LoRA adapter (merged or none).",
      "",
      "`d2f_model.json` holds the ModelConfig, the LoRA config and the original config.json; the tokenizer "
      "files sit beside it. Layers are stacked on the leading axis (L):",
      "",
      "| path | shape |",
      "|---|---|",
      tree,
      "",
  ])


def hf_card(config: ModelConfig, base: str | None, attention: str | None = None) -> str:
  """The card of an exported Hugging Face checkpoint (LLaDA / Dream file layout). base: the model it was
  trained or converted from; attention: config.json's ATTENTION_KEY (None: not recorded)."""
  attends = (f"Trained to attend {_ATTENDS.get(attention, repr(attention))} (config.json `{ATTENTION_KEY}`)."
             if attention else f"How it was trained to attend is not recorded (no config.json `{ATTENTION_KEY}`).")
  return "\n".join([
      _front_matter(library_name="d2f_jax", base_model=base, tags=["d2f", config.family, "diffusion-llm"]),
      f"# {config.family} checkpoint written by d2f_jax",
      "",
      f"{_shape_line(config)}, in the file layout of {_READS.get(config.family, config.family)}: "
      f"`config.json` + safetensors. {attends}",
      "",
      f"Fine-tuned or converted from `{base}`." if base else "Not derived from a named base checkpoint.",
      "",
      "Load it with d2f_jax: `d2f_jax.load_model(this_dir)`, then `model.generate(text)`. "
      + _TRANSFORMERS.get(config.family, ""),
      "",
  ])


def adapter_card(config: ModelConfig, lora: LoraConfig, base: str | None) -> str:
  """The card of a PEFT adapter exported by d2f_jax (the Hub's convention: library_name peft)."""
  return "\n".join([
      _front_matter(library_name="peft", base_model=base, tags=["d2f", "lora", config.family]),
      f"# D2F LoRA adapter for {base or 'a ' + config.family + ' base'}",
      "",
      f"LoRA {_lora_line(lora)}, written by d2f_jax's `export_peft_adapter` in PEFT's format "
      "(`adapter_config.json` + `adapter_model.safetensors`). Load it with "
      "`d2f_jax.load_model(base, lora_dir=this_dir)` or `peft.PeftModel.from_pretrained(base_model, this_dir)`.",
      "",
  ])
