"""Config files load for every documented arg, and bad fields fail early with their names."""

import os

import pytest

from d2f_jax.train import config as config_lib
from d2f_jax.train.metrics import forward_flops_per_token, train_flops_per_token
from d2f_jax.models import LLADA_8B, LoraConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def get_config(name, arg=None):
  return config_lib.load_config_file(os.path.join(ROOT, "configs", f"{name}.py") + (f":{arg}" if arg else ""))


@pytest.mark.parametrize("name,arg", [("llada_8b", None), ("llada_8b", "tpu_v5p_64"), ("dream_7b", "gpu_8xh100"),
                                      ("dream_7b", "tpu_v5e_64,runlocal"), ("llada_8b", "runlocal"),
                                      ("tiny", None), ("tiny", "family=dream,full"), ("llada2_mini", None),
                                      ("llada2_mini", "runlocal"), ("llada2_flash", None)])
def test_config_files_validate(name, arg):
  c = get_config(name, arg)
  if c.model.path is None and not c.model.synthetic:  # the 8B configs take the checkpoint from the command line
    with pytest.raises(ValueError, match="model.path"):
      config_lib.validate(c)
    c.model.path, c.data.path = "/ckpt/base", "/data/qa.jsonl"
  config_lib.validate(c)


def test_reference_hyper_parameters():
  llada, dream = get_config("llada_8b", "tpu_v5p_64"), get_config("dream_7b")
  for c in (llada, dream):
    assert (c.block_size, c.lora.rank, c.lora.alpha, c.lora.dropout) == (16, 32, 32.0, 0.1)
    assert tuple(c.lora.targets) == ("q", "k", "v", "o")
    assert (c.optim.b1, c.optim.b2, c.optim.weight_decay, c.optim.eps, c.optim.clip) == (0.9, 0.95, 0.05, 1e-8, 1.0)
    assert (c.schedule.kind, c.schedule.low, c.schedule.high) == ("monotone", 0.2, 0.7)
  assert (llada.optim.lr, dream.optim.lr) == (1e-5, 5e-6)
  assert dict(llada.mesh) == dict(data=4, fsdp=8, tensor=1)


def test_parse_arg():
  arg = config_lib.parse_arg("tpu_v5p_64,runlocal,steps=3", positional="hw", hw="cpu", runlocal=False, steps=1)
  assert (arg.hw, arg.runlocal, arg.steps) == ("tpu_v5p_64", True, 3)
  with pytest.raises(ValueError, match="unknown config arg 'stpes'"):
    config_lib.parse_arg("stpes=3", steps=1)
  with pytest.raises(ValueError, match="unknown hardware preset 'tpu_v9'"):
    get_config("llada_8b", "tpu_v9")


@pytest.mark.parametrize("field,value,match", [
    ("micro_batches", 3, "micro_batches"), ("schedule.kind", "cosine", "schedule.kind"),
    ("mesh.tensor", 0, "mesh.tensor"), ("loss_chunk", 7, "loss_chunk"), ("finetune", "qlora", "finetune"),
    ("optim.lr", 0.0, "optim.lr"), ("data.seq_len", 8, "data.seq_len"), ("mdm.semi_ar", 1.5, "mdm.semi_ar"),
    ("mdm.suffix_weight", -0.5, "mdm.suffix_weight"),
    ("mdm.window", 0, "mdm.window")])
def test_bad_fields_are_named(field, value, match):
  c = get_config("tiny")
  c.update_from_flattened_dict({field: value})
  with pytest.raises(ValueError, match=match):
    config_lib.validate(c)


def test_flops_count_the_teacher_and_the_lora_backward():
  fwd = forward_flops_per_token(LLADA_8B, 1024)
  assert 14e9 < fwd < 20e9  # ~2 x 8B parameters plus attention at length 1024
  lora = LoraConfig()
  assert train_flops_per_token(LLADA_8B, 1024, lora) == pytest.approx(3 * forward_flops_per_token(LLADA_8B, 1024,
                                                                                                  lora))
  assert train_flops_per_token(LLADA_8B, 1024, None) == 4 * fwd


def test_the_llada2_configs_keep_the_recipe_at_llada2s_block():
  """LLaDA2 was trained and decodes in blocks of 32 (its prompt too, from position 0): the student learns at that
  block; the rest is the authors' LoRA recipe. mini defaults to one 8xH100 host, flash to a v5p-64 pod."""
  mini, flash, llada = get_config("llada2_mini"), get_config("llada2_flash"), get_config("llada_8b", "gpu_8xh100")
  for c in (mini, flash):
    assert (c.block_size, c.optim.lr, c.lora.rank, tuple(c.lora.targets)) == (32, 1e-5, 32, ("q", "k", "v", "o"))
    assert (c.model.path, c.model.preset) == (None, None)  # the checkpoint comes from the command line
  assert (mini.mesh.to_dict(), mini.batch_size) == (llada.mesh.to_dict(), llada.batch_size)
  assert dict(flash.mesh) == dict(get_config("llada_8b", "tpu_v5p_64").mesh) and flash.batch_size == 64
  assert get_config("llada2_mini", "runlocal").model.preset == "tiny-llada2"

