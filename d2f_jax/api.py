"""`d2f_jax.load_model`: one call from a Hugging Face or converted directory to a ready model.

The returned `Model` keeps the model split into a static graph and a parameter state, the form
every jitted entry point (decoders, trainer) takes, plus the tokenizer found in the same directory.

On a mesh, `load_model(path, mesh=mesh)` places each weight straight from host memory into its training
sharding (heads / mlp / vocab over tensor, embed over fsdp): no device ever holds the whole model, which
is what lets an 8B model in bf16 load onto chips smaller than it. `model.shard(mesh)` moves a loaded one.
`generate` / `evaluate` then decode on that mesh.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from d2f_jax.convert.errors import ConvertError
from d2f_jax.convert.source import TOKENIZER_FILES, load_tokenizer  # noqa: F401  (public here too)
from d2f_jax.decode.mesh import DecodeMesh
from d2f_jax.decode.runner.model import shard_model, with_attention
from d2f_jax.models import LoraConfig, ModelConfig, Transformer, abstract_model, logits_for_mode



@dataclasses.dataclass(frozen=True)
class Model:
  """The model handle every decoder, evaluator and the trainer's exports take: a config, the static graph and
  the parameter state (the form every jitted entry point takes), with the tokenizer, the separate LoRA config,
  the directory it came from and (once `shard`ed) the mesh the state lives on.

  `load_model` returns one; `Model.from_module` wraps a module built in memory. Text in, text out:
  `model.generate("2+3=", method="d2f")`; ids in, a DecodeResult out: `d2f_jax.decode.generate`.
  """

  config: ModelConfig
  graphdef: Any  # nnx.GraphDef: static, hashable
  state: Any  # nnx.State: parameters (and LoRA parameters, when kept separate)
  tokenizer: Any = None
  placement: DecodeMesh | None = None
  lora: Any = None  # LoraConfig when the LoRA parameters are kept separate
  source: str = ""  # the directory it was loaded from ("" when built in memory)

  @classmethod
  def from_module(cls, module: nnx.Module, tokenizer=None) -> "Model":
    graphdef, state = nnx.split(module)
    return cls(config=module.config, graphdef=graphdef, state=state, tokenizer=tokenizer,
               lora=getattr(module, "lora", None))

  @property
  def mesh(self):
    return None if self.placement is None else self.placement.mesh

  @property
  def module(self) -> Transformer:
    """The model as an nnx module over fresh Variables: changing it (e.g. scaling a weight) leaves this frozen
    handle's state as it was."""
    return nnx.merge(self.graphdef, jax.tree.map(lambda x: x, self.state))

  def shard(self, mesh, rules=None) -> "Model":
    """A copy with its weights in the logical `rules`' shardings on `mesh` (default rules: training's)."""
    return shard_model(self, mesh, rules)

  def with_attention(self, impl: str) -> "Model":
    """A copy whose attention runs as `impl` ('auto', 'xla', 'pallas', 'interpret_gpu', 'interpret_tpu')."""
    return with_attention(self, impl)

  def generate(self, prompt: str | Sequence[str], *, method: str = "d2f", chat: bool = False, key=None,
               **settings) -> str | list[str]:
    """Decode text: one prompt -> its completion, a list of prompts -> a list (decoded as one batch, each
    row's tokens those of its batch-1 decode). `settings` are DecodeConfig fields (block_size,
    max_new_tokens, tau_add, tau_act, tau_conf, temperature, ...); `chat` wraps each prompt as one user turn
    of the model's chat template. The completion stops at the first stop token, which is not included."""
    from d2f_jax.decode import DecodeConfig, generate
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    if not prompts or not all(isinstance(p, str) for p in prompts):
      raise TypeError(f"prompt must be a string or a non-empty list of strings, got {prompt!r:.80}")
    result = generate(self, [self.encode(p, chat=chat) for p in prompts],
                      DecodeConfig(method=method, **settings), key=key)
    texts = [self.decode(ids) for ids in result.to_lists()]
    return texts[0] if isinstance(prompt, str) else texts

  def logits(self, token_ids, *, attention_mask=None, mode: str = "bidirectional", prompt_len=None,
             block_size: int | None = None, align: bool = True) -> jax.Array:
    """Logits [B, T, V] (fp32) for token ids [B, T] under an attention mode.

    attention_mask [B, T] marks real tokens (left padding = 0); positions follow it. `align=True` applies
    Dream's logit shift so that row i predicts token i for every family; rows of padding are zero.
    """
    tokens = jnp.asarray(token_ids, jnp.int32)
    if tokens.ndim != 2:
      raise ValueError(f"token_ids must be [batch, length], got shape {tokens.shape}")
    if attention_mask is None:
      attention_mask = jnp.ones_like(tokens)
    attention_mask = jnp.asarray(attention_mask, jnp.int32)
    if attention_mask.shape != tokens.shape:
      raise ValueError(f"attention_mask shape {attention_mask.shape} != token_ids shape {tokens.shape}")
    if int(tokens.max()) >= self.config.vocab_size or int(tokens.min()) < 0:
      raise ValueError(f"token ids must lie in [0, {self.config.vocab_size}), got range "
                       f"[{int(tokens.min())}, {int(tokens.max())}]")
    return logits_for_mode(self.graphdef, self.state, tokens, attention_mask, mode=mode,
                           prompt_len=prompt_len, block_size=block_size, align=align)

  def encode(self, text: str, *, chat: bool = False) -> list[int]:
    """Token ids of `text` (as one user turn with the chat template when `chat`)."""
    if self.tokenizer is None:
      raise ValueError(f"no tokenizer was found in {self.source!r} (looked for {', '.join(TOKENIZER_FILES)})")
    if chat:
      return list(self.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                     add_generation_prompt=True, tokenize=True,
                                                     return_dict=False))
    return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

  def decode(self, ids: Sequence[int]) -> str:
    if self.tokenizer is None:
      raise ValueError(f"no tokenizer was found in {self.source!r}")
    return self.tokenizer.decode(list(ids), skip_special_tokens=True)


def model_from_params(config: ModelConfig, params: dict, lora: LoraConfig | None = None,
                      lora_params: dict | None = None, placement=None) -> tuple[Any, Any]:
  """(graphdef, state) of a Transformer holding `params` (pure nested dict in our layout), without
  materialising a random initialisation first. Shapes are checked leaf by leaf. With `placement` (a
  decode.DecodeMesh) host arrays go slice by slice straight into their shardings."""
  abstract = abstract_model(config, lora)
  graphdef, state = nnx.split(abstract)
  values = {**params, "layers": {**params.get("layers", {}), **((lora_params or {}).get("layers", {}))}}
  expected = dict(nnx.to_flat_state(state))
  given = dict(_flatten(values))
  missing = sorted(".".join(map(str, p)) for p in expected if p not in given)
  extra = sorted(".".join(map(str, p)) for p in given if p not in expected)
  if missing or extra:
    raise ValueError(f"parameters do not fit the model: missing {missing or 'none'}, unexpected {extra or 'none'}")
  for path, var in expected.items():
    value = given[path]
    if tuple(value.shape) != tuple(var.shape):
      raise ValueError(f"parameter {'.'.join(map(str, path))} has shape {tuple(value.shape)}, "
                       f"expected {tuple(var.shape)}")
  if placement is not None:
    from d2f_jax.decode.mesh import place_state
    nnx.replace_by_pure_dict(state, jax.tree.map(lambda v: _host_cast(v, config.weight_dtype), values))
    return graphdef, place_state(state, placement)
  nnx.replace_by_pure_dict(state, jax.tree.map(lambda v: jnp.asarray(v, config.weight_dtype)
                                          if _is_float(v) else jnp.asarray(v), values))
  return graphdef, state


def _is_float(v) -> bool:
  dtype = np.asarray(v).dtype if not hasattr(v, "dtype") else np.dtype(v.dtype)
  return np.issubdtype(dtype, np.floating) or dtype.name == "bfloat16"


def _host_cast(v, dtype):
  """A host (numpy) copy in `dtype` for floats; device arrays are left where they are."""
  if isinstance(v, jax.Array):
    return v.astype(dtype) if _is_float(v) else v
  v = np.asarray(v)
  return v.astype(dtype) if _is_float(v) and v.dtype != dtype else v


def _flatten(tree: dict, prefix: tuple = ()):
  for key, value in tree.items():
    if isinstance(value, dict):
      yield from _flatten(value, prefix + (key,))
    else:
      yield prefix + (key,), value


def load_model(path: str, dtype: str | None = None, *, lora_dir: str | None = None, merge_lora: bool = True,
               allow_pickle: bool = False, progress: bool = False, attention: str | None = None, mesh=None,
               rules=None, allow_nonfinite: bool = False, format: str | None = None,  # noqa: A002
               layer_loop: str | None = None, expert_dispatch: str | None = None) -> Model:
  """Load a model from a Hugging Face directory (config.json + safetensors), a converted directory, or a
  Hub id ("GSAI-ML/LLaDA-8B-Instruct[@revision]") through the local Hugging Face cache (convert/source.py).

  dtype: storage and compute dtype ('bfloat16', 'float32'); default keeps the checkpoint's.
  lora_dir: a PEFT adapter directory, merged into the weights (`merge_lora`) or kept as separate LoRA
  parameters (the form the trainer continues from).
  attention: ModelConfig.attention_impl ('auto', 'xla', 'pallas', ...); default keeps the config's.
  layer_loop: ModelConfig.layer_loop ('auto', 'scan', 'unroll'); default keeps the config's ('auto').
  expert_dispatch: MoEConfig.dispatch of a mixture-of-experts model ('ragged', 'dense', 'auto'); default
  keeps the config's ('ragged'); refused on a dense model.
  mesh / rules: place the weights straight into their shardings on this jax Mesh (axes data, fsdp,
  tensor) by these logical-axis rules (default: training's, d2f_jax.sharding.DEFAULT_RULES).
  allow_nonfinite: load weights holding NaN / inf (refused by default, naming the tensor), for forensics.
  format: 'converted' or 'hf', for a directory holding both (refused without it).
  A tokenizer with more tokens than the embedding has rows is refused (its ids past the rows have no weights).
  """
  from d2f_jax.decode.mesh import as_decode_mesh
  from d2f_jax import convert

  path = convert.resolve_model_dir(path)
  config, params, lora_cfg, lora_params = convert.load_params(path, dtype, allow_pickle=allow_pickle,
                                                              progress=progress, allow_nonfinite=allow_nonfinite,
                                                              format=format)
  if lora_dir is not None:
    if lora_cfg is not None:
      raise ValueError(f"{path!r} already carries a LoRA adapter; merge it before adding {lora_dir!r}")
    lora_cfg, lora_params = convert.read_peft_adapter(lora_dir, config, allow_nonfinite=allow_nonfinite)
    if merge_lora:
      params = convert.merge_lora(params, lora_cfg, lora_params, config, inplace=True,
                                  allow_nonfinite=allow_nonfinite)
      lora_cfg = lora_params = None
  if attention is not None:
    config = config.replace(attention_impl=attention)
  if layer_loop is not None:
    config = config.replace(layer_loop=layer_loop)
  if expert_dispatch is not None:
    config = config.with_expert_dispatch(expert_dispatch)
  placement = as_decode_mesh(mesh, rules)
  graphdef, state = model_from_params(config, params, lora_cfg, lora_params, placement=placement)
  tokenizer = load_tokenizer(path)
  if tokenizer is not None and len(tokenizer) > config.vocab_size:
    raise ConvertError(f"the tokenizer in {path!r} has {len(tokenizer)} tokens, but the model's embedding has "
                               f"{config.vocab_size} rows (config vocab_size): ids from {config.vocab_size} on would "
                               "have no weights; the tokenizer belongs to another model")
  return Model(config=config, graphdef=graphdef, state=state, tokenizer=tokenizer,
                     lora=lora_cfg, source=path, placement=placement)


def load_from_flags(args, mesh=None) -> Model:
  """The model a command line names (--model, --lora_dir, --dtype, --attention, --layer_loop,
  --expert_dispatch; generate, evaluate, serve):
  a model that cannot be loaded is one `error:` line naming --model (exit 2), never a traceback."""
  from d2f_jax.usage import UsageError
  try:
    return load_model(args.model, dtype=args.dtype, lora_dir=args.lora_dir, attention=args.attention, mesh=mesh,
                      layer_loop=args.layer_loop, expert_dispatch=args.expert_dispatch)
  except (OSError, ValueError) as e:  # ConvertError is a ValueError
    raise UsageError(f"--model {args.model}: {e}") from None
