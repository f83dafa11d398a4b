"""PEFT LoRA adapters: reading into our layout, merging, exporting, and refusing adapters of another base.

Expected values come from the raw adapter tensors (official safetensors package) and PEFT's own formula
W' = W + scale * B @ A on [out, in] weights, computed here in numpy.
"""

import json
import os

import jax
import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from d2f_jax import convert
from d2f_jax.convert import synthetic
from d2f_jax.models import TINY_DREAM, TINY_LLADA, LoraConfig

BF16 = np.dtype(ml_dtypes.bfloat16)
ALL = ("q", "k", "v", "o", "gate", "up", "down")
MODULES = {
    "llada": ("base_model.model.model.transformer.blocks.{}.",
              dict(q="q_proj", k="k_proj", v="v_proj", o="attn_out", gate="ff_proj", up="up_proj", down="ff_out")),
    "dream": ("base_model.model.model.layers.{}.",
              dict(q="self_attn.q_proj", k="self_attn.k_proj", v="self_attn.v_proj", o="self_attn.o_proj",
                   gate="mlp.gate_proj", up="mlp.up_proj", down="mlp.down_proj")),
}
BASE_NAMES = {  # HF base weight of each target, layer {}
    "llada": ("model.transformer.blocks.{}.", MODULES["llada"][1]),
    "dream": ("model.layers.{}.", MODULES["dream"][1]),
}


def raw(path) -> dict[str, np.ndarray]:
  out = {}
  for name in sorted(os.listdir(path)):
    if name.endswith(".safetensors"):
      for key, t in load_file(os.path.join(path, name)).items():
        out[key] = t.view(torch.int16).numpy().view(BF16) if t.dtype == torch.bfloat16 else t.numpy()
  return out


def peft_ab(family, adapter, target, layer):
  prefix, names = MODULES[family]
  module = prefix.format(layer) + names[target]
  return adapter[module + ".lora_A.weight"], adapter[module + ".lora_B.weight"]


def to_ours(target, cfg, w):
  """A [out, in] HF weight (or delta) in our [in, out] layout (heads packed with head_dim)."""
  return w.T


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
  made = {}

  def get(family, dtype="float32", targets=("q", "k", "v", "o"), rank=4, alpha=8.0, rslora=False, cfg=None):
    key = (family, dtype, targets, rank, alpha, rslora, cfg)
    if key not in made:
      root = tmp_path_factory.mktemp(f"lora_{family}")
      config = cfg or (TINY_LLADA if family == "llada" else TINY_DREAM)
      synthetic.write_hf_checkpoint(root / "hf", config, seed=1, dtype=dtype, shards=2)
      lora = LoraConfig(rank=rank, alpha=alpha, dropout=0.1, targets=targets, use_rslora=rslora)
      synthetic.write_peft_adapter(root / "adapter", config, lora, seed=2)
      made[key] = (str(root / "hf"), str(root / "adapter"), lora)
    return made[key]
  return get


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_adapter_layout_matches_manual_math(dirs, family):
  hf_dir, adapter_dir, lora = dirs(family, targets=ALL)
  config, _ = convert.load_hf_params(hf_dir, progress=False)
  got_lora, params = convert.read_peft_adapter(adapter_dir, config)
  assert got_lora == lora
  adapter = raw(adapter_dir)
  assert len(adapter) == 2 * len(ALL) * config.num_layers
  for layer in range(config.num_layers):
    for t in ALL:
      A, B = peft_ab(family, adapter, t, layer)
      a, b = params["layers"][f"{t}_lora_a"][layer], params["layers"][f"{t}_lora_b"][layer]
      want_a, want_b = A.T, B.T  # [in, r], [r, out]: every projection, o included, is one matrix
      np.testing.assert_array_equal(a, want_a)
      np.testing.assert_array_equal(b, want_b)
      # our update x @ a @ b equals PEFT's x @ A.T @ B.T
      x = np.random.default_rng(layer).standard_normal((3,) + a.shape[:-1]).astype(np.float32)
      flat_x = x.reshape(3, -1)
      np.testing.assert_allclose(np.tensordot(np.tensordot(x, a, a.ndim - 1), b, 1).reshape(3, -1),
                                 flat_x @ A.T @ B.T, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family,rslora", [("llada", False), ("dream", True)])
def test_merge_equals_w_plus_scale_b_a(dirs, family, rslora):
  hf_dir, adapter_dir, lora = dirs(family, targets=ALL, rank=4, alpha=16.0, rslora=rslora)
  config, params = convert.load_hf_params(hf_dir, progress=False)
  lora_cfg, lora_params = convert.read_peft_adapter(adapter_dir, config)
  assert lora_cfg.scale == (16.0 / 2.0 if rslora else 16.0 / 4)
  merged = convert.merge_lora(params, lora_cfg, lora_params, config)
  base, adapter = raw(hf_dir), raw(adapter_dir)
  prefix, names = BASE_NAMES[family]
  for t in ALL:
    for layer in range(config.num_layers):
      W = base[prefix.format(layer) + names[t] + ".weight"].astype(np.float64)
      A, B = (m.astype(np.float64) for m in peft_ab(family, adapter, t, layer))
      want = to_ours(t, config, W + lora_cfg.scale * (B @ A))
      np.testing.assert_allclose(merged["layers"][t][layer], want, rtol=1e-6, atol=1e-6)
      assert not np.allclose(params["layers"][t][layer], want, atol=1e-4)  # the update is not negligible
  for key in ("embedding", "final_norm", "lm_head"):
    assert merged[key] is params[key]


def test_merge_into_bf16_rounds_once_from_fp32(dirs):
  hf_dir, adapter_dir, _ = dirs("llada", dtype="bfloat16")
  config, params = convert.load_hf_params(hf_dir, progress=False)
  lora_cfg, lora_params = convert.read_peft_adapter(adapter_dir, config)
  before = params["layers"]["q"].copy()
  merged = convert.merge_lora(params, lora_cfg, lora_params, config)
  np.testing.assert_array_equal(params["layers"]["q"].view(np.uint16), before.view(np.uint16))  # not in place
  base, adapter = raw(hf_dir), raw(adapter_dir)
  for layer in range(config.num_layers):
    W = base[f"model.transformer.blocks.{layer}.q_proj.weight"].astype(np.float32)
    A, B = peft_ab("llada", adapter, "q", layer)
    want = to_ours("q", config, W + np.float32(lora_cfg.scale) * (B @ A)).astype(BF16)
    got = merged["layers"]["q"][layer]
    assert got.dtype == BF16
    diff = np.abs(got.astype(np.float32) - want.astype(np.float32))
    assert diff.max() <= 2.0 ** -7 * np.abs(want.astype(np.float32)).max()  # at most one bf16 ulp apart
    assert (diff == 0).mean() > 0.99
  inplace = convert.merge_lora(params, lora_cfg, lora_params, config, inplace=True)
  assert inplace["layers"]["q"] is params["layers"]["q"]
  np.testing.assert_array_equal(inplace["layers"]["q"].view(np.uint16), merged["layers"]["q"].view(np.uint16))


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_export_then_reread_is_identical(dirs, tmp_path, family):
  _, adapter_dir, lora = dirs(family)
  config = TINY_LLADA if family == "llada" else TINY_DREAM
  lora_cfg, params = convert.read_peft_adapter(adapter_dir, config)
  convert.export_peft_adapter(tmp_path / "out", config, lora_cfg, params)
  again_cfg, again = convert.read_peft_adapter(tmp_path / "out", config)
  assert again_cfg == lora_cfg == lora
  for key, value in params["layers"].items():
    np.testing.assert_array_equal(again["layers"][key], value)
  original, exported = raw(adapter_dir), raw(tmp_path / "out")
  assert sorted(original) == sorted(exported)
  assert all(original[n].tobytes() == exported[n].tobytes() and original[n].dtype == exported[n].dtype
             for n in original)
  cfg = json.load(open(tmp_path / "out" / "adapter_config.json"))
  want_targets = ["attn_out", "k_proj", "q_proj", "v_proj"] if family == "llada" else \
      ["k_proj", "o_proj", "q_proj", "v_proj"]
  assert (cfg["peft_type"], cfg["task_type"], cfg["bias"], cfg["r"], cfg["lora_alpha"], cfg["lora_dropout"],
          cfg["target_modules"]) == ("LORA", "CAUSAL_LM", "none", 4, 8, 0.1, want_targets)


def test_kept_separate_through_converted_dir(dirs, tmp_path):
  hf_dir, adapter_dir, lora = dirs("dream")
  convert.convert_hf_dir(hf_dir, tmp_path / "sep", lora_dir=adapter_dir, progress=False)
  config, params, lora_cfg, lora_params = convert.restore_converted(tmp_path / "sep")
  assert lora_cfg == lora
  _, want = convert.read_peft_adapter(adapter_dir, config)
  for key, value in want["layers"].items():
    np.testing.assert_array_equal(lora_params["layers"][key], value)
  both = convert.with_lora(params, lora_params)
  assert convert.split_lora(both)[1]["layers"].keys() == want["layers"].keys()
  # The trainer's path: restore straight into the abstract state of a LoRA model (jax arrays on a device).
  from flax import nnx

  from d2f_jax.models import Transformer
  abstract = nnx.state(nnx.eval_shape(lambda: Transformer(config, lora_cfg, rngs=nnx.Rngs(0))), nnx.Param)
  _, on_device, _, lora_on_device = convert.restore_converted(tmp_path / "sep", target=abstract)
  for key, value in convert.mapping.flatten(convert.with_lora(on_device, lora_on_device)).items():
    assert isinstance(value, jax.Array)
    np.testing.assert_array_equal(np.asarray(value), convert.mapping.flatten(both)[key])
  convert.convert_hf_dir(hf_dir, tmp_path / "merged", lora_dir=adapter_dir, merge=True, progress=False)
  _, merged, no_lora, _ = convert.restore_converted(tmp_path / "merged")
  assert no_lora is None
  np.testing.assert_array_equal(merged["layers"]["o"],
                                convert.merge_lora(params, lora_cfg, lora_params, config)["layers"]["o"])


def test_adapter_for_other_family_is_refused(dirs, tmp_path):
  _, dream_adapter, _ = dirs("dream")
  with pytest.raises(convert.AdapterError, match="unsupported target module name 'o_proj' for a llada base.*"
                                                 "is a dream module name"):
    convert.read_peft_adapter(dream_adapter, TINY_LLADA)
  _, dream_q_only, _ = dirs("dream", targets=("q",))
  with pytest.raises(convert.AdapterError, match=r"tensor 'base_model\.model\.model\.layers\.0\.self_attn\.q_proj\."
                                                 r"lora_A\.weight' names a dream module"):
    convert.read_peft_adapter(dream_q_only, TINY_LLADA)


def test_adapter_with_wrong_shapes_names_the_tensor(dirs):
  wider = TINY_LLADA.replace(embed_dim=96, head_dim=24)
  _, adapter_dir, _ = dirs("llada", cfg=wider)
  with pytest.raises(convert.AdapterError, match=r"tensor 'base_model\.model\.model\.transformer\.blocks\.0\..*"
                                                 r"has shape \[(4, 96|96, 4)\], expected \[(4, 64|64, 4)\]"):
    convert.read_peft_adapter(adapter_dir, TINY_LLADA)


def test_adapter_config_errors(dirs, tmp_path):
  _, adapter_dir, _ = dirs("llada")
  cfg = json.load(open(os.path.join(adapter_dir, "adapter_config.json")))

  def with_config(name, **changes):
    d = tmp_path / name
    d.mkdir()
    os.symlink(os.path.join(adapter_dir, "adapter_model.safetensors"), d / "adapter_model.safetensors")
    json.dump({**cfg, **changes}, open(d / "adapter_config.json", "w"))
    return d

  with pytest.raises(convert.AdapterError, match="unsupported target module name 'foo_proj'.*supported:.*attn_out"):
    convert.read_peft_adapter(with_config("foo", target_modules=["q_proj", "foo_proj"]), TINY_LLADA)
  with pytest.raises(convert.AdapterError, match="use_dora=True is not supported"):
    convert.read_peft_adapter(with_config("dora", use_dora=True), TINY_LLADA)
  with pytest.raises(convert.AdapterError, match="tensor .*blocks.0.attn_out.lora_A.weight.* not in target_modules"):
    convert.read_peft_adapter(with_config("fewer", target_modules=["q_proj", "k_proj", "v_proj"]), TINY_LLADA)
  empty = tmp_path / "empty"
  empty.mkdir()
  with pytest.raises(FileNotFoundError, match="has no adapter_config.json"):
    convert.read_peft_adapter(empty, TINY_LLADA)
