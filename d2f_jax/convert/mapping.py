"""Declarative name / layout tables between Hugging Face checkpoints and our parameter tree.

One table per family; each row is (HF tensor name with `{i}` for the layer, our parameter path, transform).
A transform is a *view*: `hf_view(ours)` shows a (per-layer slice of a) parameter of ours in the HF layout,
so import writes through the view and export copies out of it; the two directions cannot disagree.
Our layout (see models/transformer.py): every projection [in, out], heads packed with head_dim (q [E,H*D],
k/v [E,K*D], o [H*D,E]), gate/up [E,F], down [F,E], lm_head [E,V]; HF Linear weights are [out, in].
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from d2f_jax.models import PROJECTIONS, proj_shape
from d2f_jax.models.config import LORA_TARGETS, LoraConfig, ModelConfig


@dataclasses.dataclass(frozen=True)
class Transform:
  """`kind`: 'identity' (same shape), 'flatten' (HF keeps it 1-D) or 'linear' (HF [out, in] = ours
  reshaped to [in, out] and transposed; the first `n_in` axes of ours are the input axes)."""
  kind: str
  n_in: int = 1

  def hf_shape(self, ours: tuple[int, ...]) -> tuple[int, ...]:
    if self.kind == "identity":
      return tuple(ours)
    if self.kind == "flatten":
      return (math.prod(ours),)
    return (math.prod(ours[self.n_in:]), math.prod(ours[:self.n_in]))

  def hf_view(self, ours: np.ndarray) -> np.ndarray:
    """A view (never a copy) of `ours` in the HF layout; `ours` must be C-contiguous."""
    if not ours.flags.c_contiguous:
      raise ValueError(f"hf_view needs a C-contiguous array, got strides {ours.strides}")
    if self.kind == "identity":
      return ours
    if self.kind == "flatten":
      return ours.reshape(-1)
    n_in = math.prod(ours.shape[:self.n_in])
    return ours.reshape(n_in, -1).T


IDENTITY = Transform("identity")
FLATTEN = Transform("flatten")
LINEAR = Transform("linear", n_in=1)  # ours [in, out] e.g. q [E, H*D], gate [E, F]


@dataclasses.dataclass(frozen=True)
class Row:
  hf: str  # HF tensor name; '{i}' marks a per-layer tensor
  ours: str  # our parameter path, '/'-separated
  transform: Transform
  when: str | None = None  # 'qkv_bias' | 'untied': present only for such configs

  @property
  def per_layer(self) -> bool:
    return "{i}" in self.hf

  def applies(self, config: ModelConfig) -> bool:
    if self.when == "qkv_bias":
      return config.qkv_bias
    if self.when == "untied":
      return not config.tie_embeddings
    return True


@dataclasses.dataclass(frozen=True)
class FamilyTable:
  family: str
  rows: tuple[Row, ...]
  peft_prefix: str = "base_model.model."  # PEFT wraps the whole model: base_model.model.<module path>

  def module(self, target: str) -> str:
    """HF module path ('...{i}.q_proj') of one of our LoRA targets ('q')."""
    for row in self.rows:
      if row.ours == f"layers/{target}":
        return row.hf[:-len(".weight")]
    raise KeyError(f"{self.family} has no module for LoRA target {target!r}")

  def peft_target(self, target: str) -> str:
    """PEFT's target_modules name of one of our targets ('o' -> 'attn_out' / 'o_proj')."""
    return self.module(target).rsplit(".", 1)[-1]


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

TABLES = {"llada": LLADA, "dream": DREAM}

# Tensors some checkpoints carry that are buffers, not parameters.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def table_for(family: str) -> FamilyTable:
  if family not in TABLES:
    raise ValueError(f"no Hugging Face mapping for family {family!r}; known: {sorted(TABLES)}")
  return TABLES[family]


# --- our parameter shapes --------------------------------------------------------------------------

def param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
  """Shape of every parameter of ours, by '/'-path (the Transformer's nnx.Param layout)."""
  L, E, H, K, D, V = (config.num_layers, config.embed_dim, config.num_heads, config.num_kv_heads,
                      config.head_dim, config.vocab_size)
  shapes = {"embedding": (V, E), "layers/attn_norm": (L, E), "layers/mlp_norm": (L, E), "final_norm": (E,)}
  shapes.update({f"layers/{name}": (L, *proj_shape(name, config)) for name in PROJECTIONS})
  if config.qkv_bias:
    shapes.update({"layers/q_bias": (L, H, D), "layers/k_bias": (L, K, D), "layers/v_bias": (L, K, D)})
  if not config.tie_embeddings:
    shapes["lm_head"] = (E, V)
  return shapes


def lora_shapes(config: ModelConfig, lora: LoraConfig) -> dict[str, tuple[int, ...]]:
  """Shapes of the LoRA parameters ('layers/{t}_lora_a' [L, in, r], 'layers/{t}_lora_b' [L, r, out])."""
  base = param_shapes(config)
  shapes = {}
  for t in lora.targets:
    layers, fan_in, fan_out = base[f"layers/{t}"]
    shapes[f"layers/{t}_lora_a"] = (layers, fan_in, lora.rank)
    shapes[f"layers/{t}_lora_b"] = (layers, lora.rank, fan_out)
  return shapes


def lora_transforms(target: str) -> tuple[Transform, Transform]:
  """(A transform, B transform): PEFT A [r, in] <-> ours a [in, r]; B [out, r] <-> ours b [r, out]."""
  if target not in LORA_TARGETS:
    raise ValueError(f"unknown LoRA target {target!r}; known: {LORA_TARGETS}")
  return LINEAR, LINEAR


@dataclasses.dataclass(frozen=True)
class Entry:
  """One HF tensor and where it lives in our tree: `layer` indexes the stacked axis (None: not stacked)."""
  hf: str
  path: str
  layer: int | None
  transform: Transform
  hf_shape: tuple[int, ...]


def expected_tensors(config: ModelConfig, order: str = "layer") -> dict[str, Entry]:
  """Every HF tensor a checkpoint of `config` holds: in the family's canonical order (order='layer': layer 0's
  tensors, then layer 1's, ...) or grouped by our parameter (order='param': all layers' q_proj, then k_proj...;
  lets export hold one stacked parameter at a time)."""
  table, shapes = table_for(config.family), param_shapes(config)
  entries: dict[str, Entry] = {}

  def add(row: Row, layer: int | None):
    shape = shapes[row.ours][1:] if layer is not None else shapes[row.ours]
    name = row.hf.format(i=layer)
    entries[name] = Entry(name, row.ours, layer, row.transform, row.transform.hf_shape(shape))

  rows = [r for r in table.rows if r.applies(config)]
  for row in rows:
    if not row.per_layer and row.ours == "embedding":
      add(row, None)
  if order == "param":
    for row in rows:
      for i in range(config.num_layers if row.per_layer else 0):
        add(row, i)
  elif order == "layer":
    for i in range(config.num_layers):
      for row in rows:
        if row.per_layer:
          add(row, i)
  else:
    raise ValueError(f"order must be 'layer' or 'param', got {order!r}")
  for row in rows:
    if not row.per_layer and row.ours != "embedding":
      add(row, None)
  return entries


def check_params(config: ModelConfig, params: dict, what: str = "params",
                 expected: dict[str, tuple] | None = None) -> None:
  """Parameters must be exactly the tree our Transformer has for `config`: same paths, same shapes."""
  expected = param_shapes(config) if expected is None else expected
  given = flatten(params)
  missing, extra = sorted(set(expected) - set(given)), sorted(set(given) - set(expected))
  if missing or extra:
    raise ValueError(f"{what} do not fit the config: missing {missing or 'none'}, unexpected {extra or 'none'}")
  for path, shape in expected.items():
    if tuple(given[path].shape) != tuple(shape):
      raise ValueError(f"{what} {path} has shape {tuple(given[path].shape)}, expected {tuple(shape)}")


def guess_family(names) -> str | None:
  """Which family's naming a set of tensor names follows (for 'wrong base' hints)."""
  names = list(names)
  if any(".transformer.blocks." in n or n.endswith("transformer.wte.weight") for n in names):
    return "llada"
  if any(".layers." in n and (".self_attn." in n or ".mlp." in n) for n in names):
    return "dream"
  return None


# --- nested <-> flat trees ------------------------------------------------------------------------

def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
  out = {}
  for key, value in tree.items():
    path = f"{prefix}{key}"
    if isinstance(value, dict):
      out.update(flatten(value, path + "/"))
    else:
      out[path] = value
  return out


def unflatten(flat: dict[str, Any]) -> dict:
  tree: dict = {}
  for path, value in flat.items():
    *parents, leaf = path.split("/")
    node = tree
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = value
  return tree
