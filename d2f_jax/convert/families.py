"""One name / layout table per family: (HF tensor name with `{i}` for the layer and `{j}` for the expert, our
parameter path, transform). Our layout (models/transformer.py): every projection [in, out], heads packed with
head_dim (q [E,H*D], k/v [E,K*D], o [H*D,E]), gate/up [E,F], down [F,E], experts stacked [X, ...] after the
layer, lm_head [E,V]; HF Linear weights are [out, in].
"""

from __future__ import annotations

from d2f_jax.convert.table import FLATTEN, IDENTITY, LINEAR, FamilyTable, Row

_B = "model.transformer.blocks.{i}."
LLADA = FamilyTable("llada", (
    Row("model.transformer.wte.weight", "embedding", IDENTITY),
    Row(_B + "attn_norm.weight", "layers/attn_norm", IDENTITY),
    Row(_B + "q_proj.weight", "layers/q", LINEAR),
    Row(_B + "k_proj.weight", "layers/k", LINEAR),
    Row(_B + "v_proj.weight", "layers/v", LINEAR),
    Row(_B + "q_proj.bias", "layers/q_bias", FLATTEN, when="qkv_bias"),
    Row(_B + "k_proj.bias", "layers/k_bias", FLATTEN, when="qkv_bias"),
    Row(_B + "v_proj.bias", "layers/v_bias", FLATTEN, when="qkv_bias"),
    Row(_B + "attn_out.weight", "layers/o", LINEAR),
    Row(_B + "ff_norm.weight", "layers/mlp_norm", IDENTITY),
    Row(_B + "ff_proj.weight", "layers/gate", LINEAR),  # the silu branch
    Row(_B + "up_proj.weight", "layers/up", LINEAR),
    Row(_B + "ff_out.weight", "layers/down", LINEAR),
    Row("model.transformer.ln_f.weight", "final_norm", IDENTITY),
    Row("model.transformer.ff_out.weight", "lm_head", LINEAR, when="untied"),
))

_L = "model.layers.{i}."
DREAM = FamilyTable("dream", (
    Row("model.embed_tokens.weight", "embedding", IDENTITY),
    Row(_L + "input_layernorm.weight", "layers/attn_norm", IDENTITY),
    Row(_L + "self_attn.q_proj.weight", "layers/q", LINEAR),
    Row(_L + "self_attn.k_proj.weight", "layers/k", LINEAR),
    Row(_L + "self_attn.v_proj.weight", "layers/v", LINEAR),
    Row(_L + "self_attn.q_proj.bias", "layers/q_bias", FLATTEN, when="qkv_bias"),
    Row(_L + "self_attn.k_proj.bias", "layers/k_bias", FLATTEN, when="qkv_bias"),
    Row(_L + "self_attn.v_proj.bias", "layers/v_bias", FLATTEN, when="qkv_bias"),
    Row(_L + "self_attn.o_proj.weight", "layers/o", LINEAR),
    Row(_L + "post_attention_layernorm.weight", "layers/mlp_norm", IDENTITY),
    Row(_L + "mlp.gate_proj.weight", "layers/gate", LINEAR),
    Row(_L + "mlp.up_proj.weight", "layers/up", LINEAR),
    Row(_L + "mlp.down_proj.weight", "layers/down", LINEAR),
    Row("model.norm.weight", "final_norm", IDENTITY),
    Row("lm_head.weight", "lm_head", LINEAR, when="untied"),
))

_M = "model.layers.{i}."
LLADA2 = FamilyTable("llada2", (
    Row("model.word_embeddings.weight", "embedding", IDENTITY),
    Row(_M + "input_layernorm.weight", "{stack}/attn_norm", IDENTITY),
    Row(_M + "attention.query_key_value.weight", ("{stack}/q", "{stack}/k", "{stack}/v"), LINEAR),
    Row(_M + "attention.query_key_value.bias", ("{stack}/q_bias", "{stack}/k_bias", "{stack}/v_bias"), FLATTEN,
        when="qkv_bias"),
    Row(_M + "attention.query_layernorm.weight", "{stack}/q_norm", IDENTITY, when="qk_norm"),
    Row(_M + "attention.key_layernorm.weight", "{stack}/k_norm", IDENTITY, when="qk_norm"),
    Row(_M + "attention.dense.weight", "{stack}/o", LINEAR),
    Row(_M + "post_attention_layernorm.weight", "{stack}/mlp_norm", IDENTITY),
    Row(_M + "mlp.gate_proj.weight", "{stack}/gate", LINEAR, when="dense"),
    Row(_M + "mlp.up_proj.weight", "{stack}/up", LINEAR, when="dense"),
    Row(_M + "mlp.down_proj.weight", "{stack}/down", LINEAR, when="dense"),
    Row(_M + "mlp.gate.weight", "{stack}/router", LINEAR, when="moe"),
    Row(_M + "mlp.gate.expert_bias", "{stack}/expert_bias", IDENTITY, when="expert_bias"),
    Row(_M + "mlp.experts.{j}.gate_proj.weight", "{stack}/expert_gate", LINEAR, when="moe"),
    Row(_M + "mlp.experts.{j}.up_proj.weight", "{stack}/expert_up", LINEAR, when="moe"),
    Row(_M + "mlp.experts.{j}.down_proj.weight", "{stack}/expert_down", LINEAR, when="moe"),
    Row(_M + "mlp.shared_experts.gate_proj.weight", "{stack}/shared_gate", LINEAR, when="shared"),
    Row(_M + "mlp.shared_experts.up_proj.weight", "{stack}/shared_up", LINEAR, when="shared"),
    Row(_M + "mlp.shared_experts.down_proj.weight", "{stack}/shared_down", LINEAR, when="shared"),
    Row("model.norm.weight", "final_norm", IDENTITY),
    Row("lm_head.weight", "lm_head", LINEAR, when="untied"),
))

TABLES = {"llada": LLADA, "dream": DREAM, "llada2": LLADA2}

# Tensors some checkpoints carry that are buffers, not parameters.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def table_for(family: str) -> FamilyTable:
  if family not in TABLES:
    raise ValueError(f"no Hugging Face mapping for family {family!r}; known: {sorted(TABLES)}")
  return TABLES[family]
