"""Teacher and student as one static description plus two parameter trees, placed straight onto the mesh.

LoRA mode: `frozen` holds the base weights once; the teacher is the base graph over them and the student
the LoRA graph over them plus the trainable adapter. Full fine-tune: the student is a trainable (fp32)
copy of the frozen teacher. Objectives without a teacher (mdm, ar) keep no frozen copy in full fine-tuning:
`frozen` is then empty and the trainable tree is the only one. Every tree is a pure dict in the layout of
`nnx.state(Transformer)`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from d2f_jax import convert
from d2f_jax.convert.finite import check_tree
from d2f_jax.convert.lora import peft_target_names
from d2f_jax.models import LoraConfig, ModelConfig, Transformer, abstract_model, preset
from d2f_jax import sharding

log = logging.getLogger(__name__)

BASE = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))


@dataclasses.dataclass(frozen=True)
class TrainModels:
  """The static half of the models an objective trains (student, and the frozen teacher for distill: configs
  and graphs); hashable, so a jit static argument.

  teacher=False (mdm, ar): no teacher module; the frozen tree is the LoRA base, or empty in full fine-tuning.
  """

  config: ModelConfig
  lora: LoraConfig | None  # None: full fine-tune
  train_dtype: str
  teacher_graph: Any
  student_graph: Any
  teacher: bool = True

  @classmethod
  def create(cls, config: ModelConfig, lora: LoraConfig | None, train_dtype: str = "float32", *,
             teacher: bool = True) -> "TrainModels":
    teacher_graph = nnx.split(_abstract(config, None))[0]
    student_graph = nnx.split(_abstract(config, lora), BASE, nnx.LoRAParam)[0] if lora else teacher_graph
    return cls(config, lora, train_dtype, teacher_graph, student_graph, teacher)

  @property
  def keeps_base(self) -> bool:
    """Whether frozen base weights live beside the trainable tree (a teacher, or the base under LoRA)."""
    return self.teacher or self.lora is not None

  def abstract_base(self) -> nnx.State:
    """Base parameters as ShapeDtypeStruct Variables (with their logical axes)."""
    return nnx.state(_abstract(self.config, None), nnx.Param)

  def abstract_frozen(self) -> nnx.State:
    """What stays frozen through training: the base, or nothing (full fine-tune without a teacher)."""
    return self.abstract_base() if self.keeps_base else nnx.State({})

  def abstract_trainable(self) -> nnx.State:
    """The adapter (LoRA) or the whole student (full), in `train_dtype`."""
    source = nnx.state(_abstract(self.config, self.lora), nnx.LoRAParam) if self.lora else self.abstract_base()
    dtype = jnp.dtype(self.train_dtype)
    return jax.tree.map(lambda v: v.replace(jax.ShapeDtypeStruct(v.shape, dtype)), source,
                        is_leaf=lambda x: isinstance(x, nnx.Variable))

  def student(self, trainable: dict, frozen: dict) -> Transformer:
    """The trained module over the given arrays; no copies are made."""
    if self.lora:
      return nnx.merge(self.student_graph, frozen, trainable)
    return nnx.merge(self.teacher_graph, trainable)

  def modules(self, trainable: dict, frozen: dict) -> tuple[Transformer | None, Transformer]:
    """(teacher, student) modules over the given arrays (teacher None without one); no copies are made."""
    teacher = nnx.merge(self.teacher_graph, frozen) if self.teacher else None
    return teacher, self.student(trainable, frozen)


def _abstract(config: ModelConfig, lora: LoraConfig | None) -> Transformer:
  return abstract_model(config, lora)


def pure_abstract(state: nnx.State) -> dict:
  """Pure-dict tree of ShapeDtypeStructs of an (abstract) nnx.State: the targets jit and orbax take."""
  return nnx.to_pure_dict(jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), state,
                                      is_leaf=lambda x: isinstance(x, nnx.Variable)))


# Fields that fix the parameter shapes: a checkpoint decides them, overrides may not.
SHAPE_FIELDS = ("vocab_size", "embed_dim", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim",
                "qkv_bias", "tie_embeddings", "family")


def model_config(model_cfg, *, remat: bool = False, resolved_dir: str | None = None) -> ModelConfig:
  """ModelConfig of the base in `model.dtype`: read from `model.path` (HF or converted) or built from
  `model.preset` and `model.overrides` (a dict of ModelConfig fields; with no preset it must name them all).
  resolved_dir: `model.path` already resolved by convert.resolve_model_dir (a Hub id is looked up once)."""
  overrides = model_cfg.get("overrides") or {}
  overrides = dict(overrides.to_dict() if hasattr(overrides, "to_dict") else overrides)
  if model_cfg.get("init", "path") == "path" and model_cfg.path:
    path = resolved_dir or convert.resolve_model_dir(model_cfg.path, what="config.model.path")
    config, lora = convert.read_model_config(path)
    if lora is not None:
      raise ValueError(f"config.model.path={path!r} carries a LoRA adapter; distil from a merged base "
                       "(python -m d2f_jax.convert ... --merge)")
    fixed = sorted(f for f in set(overrides) & set(SHAPE_FIELDS) if overrides[f] != getattr(config, f))
    if fixed:
      raise ValueError(f"config.model.overrides={overrides!r}: {fixed} are fixed by the checkpoint in model.path")
  elif model_cfg.preset:
    config = preset(model_cfg.preset)
  elif overrides:
    config = None
  else:
    raise ValueError("config.model.path or config.model.preset must be set")
  try:
    config = config.replace(**overrides) if config is not None else ModelConfig(**overrides)
  except TypeError as e:  # an unknown field, or (no preset) a missing one
    known = [f.name for f in dataclasses.fields(ModelConfig)]
    raise ValueError(f"config.model.overrides={overrides!r}: {e}; ModelConfig fields: {known}") from e
  if model_cfg.get("expert_dispatch") is not None:
    try:
      config = config.with_expert_dispatch(model_cfg.expert_dispatch)
    except ValueError as e:
      raise ValueError(f"config.model.expert_dispatch={model_cfg.expert_dispatch!r}: {e}") from e
  return config.replace(dtype=model_cfg.dtype, param_dtype=model_cfg.dtype, remat=bool(remat))


def load_base(models: TrainModels, path: str | None, seed: int, shardings: dict, *, progress: bool = False) -> dict:
  """Base parameters laid out with `shardings`: restored from a converted directory, streamed from an HF
  checkpoint, or (no path) randomly initialised on the devices. `path` is a local directory, already
  resolved by convert.resolve_model_dir."""
  dtype = models.config.param_dtype
  if path is None:
    def init():
      return nnx.to_pure_dict(nnx.state(Transformer(models.config, None, rngs=nnx.Rngs(seed)), nnx.Param))
    return jax.jit(init, out_shardings=shardings)()
  target = sharding.abstract_with(pure_abstract(models.abstract_base()), shardings)
  if convert.checkpoint_kind(path) == "converted":  # orbax restores straight into the shardings
    _, params, _, _ = convert.load_params(path, target=target)
    return jax.tree.map(lambda x, t: x.astype(t.dtype) if x.dtype != t.dtype else x, params, target)
  _, params, _, _ = convert.load_params(path, dtype, progress=progress and jax.process_index() == 0)
  return sharding.host_to_global(params, shardings)


def init_trainable(models: TrainModels, base: dict | None, seed: int) -> dict:
  """Fresh trainable parameters (traced; call inside jit): PEFT-style LoRA (B = 0, so the student starts as
  the teacher), a `train_dtype` copy of the base, or (full fine-tune, base None) a random init drawn
  directly in `train_dtype` (the same draws load_base(path=None) makes, at full precision)."""
  dtype = jnp.dtype(models.train_dtype)
  if models.lora is None:
    if base is None:
      model = Transformer(models.config.replace(param_dtype=models.train_dtype), None, rngs=nnx.Rngs(seed))
      return nnx.to_pure_dict(nnx.state(model, nnx.Param))
    return jax.tree.map(lambda x: x.astype(dtype), base)
  model = Transformer(models.config, models.lora, rngs=nnx.Rngs(seed))  # base weights unused: compiled away
  return jax.tree.map(lambda x: x.astype(dtype), nnx.to_pure_dict(nnx.state(model, nnx.LoRAParam)))


def gather_to_host(tree) -> Any:
  """Numpy copy of a (possibly multi-host sharded) tree on every process."""
  from jax.experimental import multihost_utils
  if jax.process_count() == 1:
    return jax.tree.map(np.asarray, jax.device_get(tree))
  return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))


def exports_adapter(models: TrainModels) -> bool:
  """Whether the student exports as a PEFT adapter: LoRA on a family PEFT can name (not LLaDA2, whose q / k / v
  are one fused Linear); otherwise it exports as a whole Hugging Face checkpoint, LoRA merged in."""
  return models.lora is not None and bool(peft_target_names(models.config.family))


def export_student(out_dir: str, models: TrainModels, trainable: dict, *, base_dir: str | None = None,
                   aux_dir: str | None = None, attention: str | None = None, frozen: dict | None = None) -> str | None:
  """The trained student in the PyTorch ecosystem's format: a PEFT adapter directory (LoRA) or a Hugging Face
  checkpoint in the base's dtype with its tokenizer (full fine-tune, or LoRA merged into the `frozen` base where
  PEFT cannot name the adapted modules; the tokenizer and side files come from `aux_dir`, default `base_dir`;
  with no base the config.json is generated in the family's format, so a randomly initialised model exports
  like a released one; `attention`, how the objective trained it to attend, goes into config.json and the
  card). All processes gather, process 0 writes."""
  merge_into = None
  if models.lora is not None and not exports_adapter(models):
    if frozen is None:
      raise ValueError(f"a LoRA student of family {models.config.family!r} exports merged into its base: pass "
                       "frozen=the base parameters")
    if jax.process_count() > 1:  # gathering the base would put all of it on every device and host
      gib = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(frozen)) / 2**30
      log.warning("not exported to %s: a LoRA student of %s exports merged into its base, which needs the whole "
                  "base (%.1f GiB) on one host, and this run has %d processes. Export it on one host with that "
                  "much memory: rerun the same command there with the config's ':cpu' hardware preset and "
                  "JAX_PLATFORMS=cpu (it resumes at the final step and exports)", out_dir, models.config.family,
                  gib, jax.process_count())
      return None
    merge_into = gather_to_host(frozen)
  host = gather_to_host(trainable)
  if jax.process_index() != 0:
    return None
  check_tree(host, f"export to {out_dir}", hint="Nothing was exported")  # a NaN / inf weight is never written out
  if exports_adapter(models):
    return convert.export_peft_adapter(out_dir, models.config, models.lora, host, base_model_name_or_path=base_dir,
                                       overwrite=True)
  if merge_into is not None:
    host = convert.merge_lora(merge_into, models.lora, host, models.config)  # new arrays for the targets only
  hf_config = os.path.join(base_dir, "config.json") if base_dir else None
  return convert.export_hf(out_dir, models.config, host, dtype=models.config.param_dtype, aux_dir=aux_dir or base_dir,
                           hf_config_json=hf_config if hf_config and os.path.isfile(hf_config) else None,
                           overwrite=True, base_model=base_dir, attention=attention)
