"""Our parameter tree against the Hugging Face checkpoints: the shapes of ours, and every HF tensor a
checkpoint of a config holds with the parts of ours it shows (from the family's table, convert/families.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from d2f_jax.convert.families import table_for
from d2f_jax.convert.table import LINEAR, Row, Transform
from d2f_jax.models import proj_shape
from d2f_jax.models.config import LORA_TARGETS, LoraConfig, ModelConfig
from d2f_jax.models.transformer import StackedLayers, moe_param_layout


# --- our parameter shapes --------------------------------------------------------------------------

def param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
  """Shape of every parameter of ours, by '/'-path (the Transformer's nnx.Param layout): the dense layers'
  stack `layers` and, with config.moe, the mixture-of-experts stack `moe_layers`."""
  E, H, K, D, V = config.embed_dim, config.num_heads, config.num_kv_heads, config.head_dim, config.vocab_size
  shapes = {"embedding": (V, E), "final_norm": (E,)}
  stacks = [("layers", config.dense_layers, False)]
  if config.moe is not None:
    stacks.append(("moe_layers", config.num_layers - config.dense_layers, True))
  for stack, n, moe in stacks:
    shapes.update({f"{stack}/attn_norm": (n, E), f"{stack}/mlp_norm": (n, E)})
    shapes.update({f"{stack}/{name}": (n, *proj_shape(name, config)) for name in StackedLayers.projections(moe)})
    if config.qkv_bias:
      shapes.update({f"{stack}/q_bias": (n, H, D), f"{stack}/k_bias": (n, K, D), f"{stack}/v_bias": (n, K, D)})
    if config.qk_norm:
      shapes.update({f"{stack}/q_norm": (n, D), f"{stack}/k_norm": (n, D)})
    if moe:
      shapes.update({f"{stack}/{name}": (n, *shape) for name, (shape, _) in moe_param_layout(config).items()})
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
class Part:
  """One of our parameters (or one layer / expert of a stacked one) inside an HF tensor: its `rows` [start,
  stop) (None: the whole tensor); `index` picks the slice of a stacked parameter ((layer,), (layer, expert))."""
  path: str
  index: tuple[int, ...] | None
  transform: Transform
  rows: tuple[int, int] | None = None

  def of(self, param: np.ndarray) -> np.ndarray:
    """This part's slice of our parameter `param`, in the HF layout (a view)."""
    return self.transform.hf_view(param[self.index] if self.index is not None else param)


@dataclasses.dataclass(frozen=True)
class Entry:
  """One HF tensor and the parts of ours it holds (several when HF fuses them, as LLaDA2's query_key_value)."""
  hf: str
  hf_shape: tuple[int, ...]
  parts: tuple[Part, ...]


def _stack_of(config: ModelConfig, layer: int) -> tuple[str, int]:
  """(our stack, index in it) of HF layer `layer`."""
  return ("layers", layer) if layer < config.dense_layers else ("moe_layers", layer - config.dense_layers)


def _entry(row: Row, shapes: dict, config: ModelConfig, layer: int | None, expert: int | None) -> Entry:
  stack, local = _stack_of(config, layer) if layer is not None else (None, None)
  index = None if layer is None else (local,) if expert is None else (local, expert)
  parts, start = [], 0
  for path in (p.format(stack=stack) for p in row.paths):
    shape = row.transform.hf_shape(shapes[path][len(index or ()):])
    rows = None if len(row.paths) == 1 else (start, start + shape[0])
    parts.append(Part(path, index, row.transform, rows))
    start += shape[0]
  hf_shape = shape if len(row.paths) == 1 else (start, *shape[1:])
  return Entry(row.hf.format(i=layer, j=expert), tuple(hf_shape), tuple(parts))


def expected_tensors(config: ModelConfig, order: str = "layer") -> dict[str, Entry]:
  """Every HF tensor a checkpoint of `config` holds: in the family's canonical order (order='layer': layer 0's
  tensors, then layer 1's, ...) or grouped by our parameter (order='param': all layers' q_proj, then k_proj...;
  lets export hold one stacked parameter at a time)."""
  table, shapes = table_for(config.family), param_shapes(config)
  if order not in ("layer", "param"):
    raise ValueError(f"order must be 'layer' or 'param', got {order!r}")
  entries: dict[str, Entry] = {}

  def add(row: Row, layer: int | None):
    for expert in range(config.moe.num_experts) if "{j}" in row.hf else (None,):
      entry = _entry(row, shapes, config, layer, expert)
      entries[entry.hf] = entry

  whole = [r for r in table.rows if not r.per_layer and r.applies(config)]
  per_layer = [r for r in table.rows if r.per_layer]
  layer_rows = [(row, i) for i in range(config.num_layers) for row in per_layer if row.applies(config, i)]
  if order == "param":
    layer_rows = sorted(layer_rows, key=lambda ri: per_layer.index(ri[0]))  # stable: layers stay in order
  for row in whole:
    if row.ours == "embedding":
      add(row, None)
  for row, i in layer_rows:
    add(row, i)
  for row in whole:
    if row.ours != "embedding":
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
  if any(".layers." in n and ".attention.query_key_value." in n for n in names):
    return "llada2"
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
