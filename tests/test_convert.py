"""Checkpoint conversion: HF LLaDA / Dream -> our layout -> orbax -> HF, and every refusal.

Expected values are computed here from the raw HF tensors, read by the official `safetensors` package, with
the layout math written out per family (independent of convert/mapping.py's table).
"""

import json
import os
import shutil
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from d2f_jax import convert
from d2f_jax.convert import safetensors as d2f_safetensors, synthetic
from d2f_jax.convert.hf_config import ConfigError
from d2f_jax.convert.safetensors import SafetensorsError
from d2f_jax.models import DREAM_7B, LLADA_8B, TINY_DREAM, TINY_LLADA, LoraConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {"llada": TINY_LLADA, "dream": TINY_DREAM}
BF16 = np.dtype(ml_dtypes.bfloat16)


def raw_tensors(hf_dir) -> dict[str, np.ndarray]:
  """Every tensor of a checkpoint directory via the official safetensors package (bf16 kept bit-exact)."""
  out = {}
  for name in sorted(os.listdir(hf_dir)):
    if name.endswith(".safetensors"):
      for key, t in load_file(os.path.join(hf_dir, name)).items():
        out[key] = t.view(torch.int16).numpy().view(BF16) if t.dtype == torch.bfloat16 else t.numpy()
  return out


def expected_params(family: str, cfg, raw: dict) -> dict:
  """Our layout from HF tensors, written out by hand: Linear [out, in] -> [in, out] (heads stay packed with
  head_dim on one axis); biases split into heads."""
  E, H, K, D = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  if family == "llada":
    p = "model.transformer.blocks.{}."
    names = dict(emb="model.transformer.wte.weight", final="model.transformer.ln_f.weight",
                 head="model.transformer.ff_out.weight", attn_norm="attn_norm", q="q_proj", k="k_proj", v="v_proj",
                 o="attn_out", mlp_norm="ff_norm", gate="ff_proj", up="up_proj", down="ff_out")
  else:
    p = "model.layers.{}."
    names = dict(emb="model.embed_tokens.weight", final="model.norm.weight", head="lm_head.weight",
                 attn_norm="input_layernorm", q="self_attn.q_proj", k="self_attn.k_proj", v="self_attn.v_proj",
                 o="self_attn.o_proj", mlp_norm="post_attention_layernorm", gate="mlp.gate_proj", up="mlp.up_proj",
                 down="mlp.down_proj")
  w = lambda i, key, kind="weight": raw[p.format(i) + names[key] + "." + kind]  # noqa: E731
  per_layer = {
      "attn_norm": lambda i: w(i, "attn_norm"), "mlp_norm": lambda i: w(i, "mlp_norm"),
      "q": lambda i: w(i, "q").T, "k": lambda i: w(i, "k").T, "v": lambda i: w(i, "v").T, "o": lambda i: w(i, "o").T,
      "gate": lambda i: w(i, "gate").T, "up": lambda i: w(i, "up").T, "down": lambda i: w(i, "down").T,
  }
  if cfg.qkv_bias:
    per_layer.update({"q_bias": lambda i: w(i, "q", "bias").reshape(H, D),
                      "k_bias": lambda i: w(i, "k", "bias").reshape(K, D),
                      "v_bias": lambda i: w(i, "v", "bias").reshape(K, D)})
  layers = {k: np.stack([f(i) for i in range(cfg.num_layers)]) for k, f in per_layer.items()}
  return {"embedding": raw[names["emb"]], "layers": layers, "final_norm": raw[names["final"]],
          "lm_head": raw[names["head"]].T}


def assert_same_bits(got, want, what=""):
  got, want = np.asarray(got), np.asarray(want)
  assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype, got.shape, want.shape)
  assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes(), what


def assert_trees_equal(got: dict, want: dict):
  got, want = convert.mapping.flatten(got), convert.mapping.flatten(want)
  assert sorted(got) == sorted(want)
  for key in want:
    assert_same_bits(got[key], want[key], key)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  """Cached synthetic checkpoints: ckpt(family, dtype, shards) -> hf_dir."""
  made = {}

  def get(family, dtype="float32", shards=1, fmt="safetensors"):
    key = (family, dtype, shards, fmt)
    if key not in made:
      made[key] = str(tmp_path_factory.mktemp(f"{family}_{dtype}_{shards}_{fmt}"))
      synthetic.write_hf_checkpoint(made[key], CONFIGS[family], seed=3, dtype=dtype, shards=shards, fmt=fmt)
    return made[key]
  return get


# --- import -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("dtype,shards", [("float32", 1), ("bfloat16", 3), ("float32", 3), ("bfloat16", 1)])
def test_import_equals_transposed_hf_tensors(ckpt, family, dtype, shards):
  hf_dir = ckpt(family, dtype, shards)
  assert os.path.exists(os.path.join(hf_dir, "model.safetensors.index.json")) == (shards > 1)
  config, params = convert.load_hf_params(hf_dir, progress=False)
  # A config.json without d2f_attention is a released (masked-diffusion) model's: it attends bidirectionally.
  assert config == CONFIGS[family].replace(dtype=dtype, param_dtype=dtype, attention_kind="bidirectional")
  assert_trees_equal(params, expected_params(family, config, raw_tensors(hf_dir)))


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_param_tree_is_the_transformers_state(ckpt, family):
  from flax import nnx

  from d2f_jax.models import Transformer
  config, params = convert.load_hf_params(ckpt(family), progress=False)
  abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
  want = jax.tree.map(lambda x: tuple(x.shape), nnx.to_pure_dict(nnx.state(abstract, nnx.Param)))
  assert jax.tree.map(lambda x: tuple(x.shape), params) == want
  lora = LoraConfig(rank=3, targets=("q", "k", "v", "o", "gate", "up", "down"))
  abstract = nnx.eval_shape(lambda: Transformer(config, lora, rngs=nnx.Rngs(0)))
  want = {k: tuple(v.shape) for k, v in nnx.to_pure_dict(nnx.state(abstract, nnx.LoRAParam))["layers"].items()}
  assert {k[len("layers/"):]: v for k, v in convert.lora_shapes(config, lora).items()} == want


def test_import_through_small_row_chunks(ckpt, monkeypatch):
  """Transposed / cast tensors are copied through a row buffer; many small chunks must give the same bits."""
  from d2f_jax.convert import hf_import
  monkeypatch.setattr(hf_import, "CHUNK_BYTES", 700)
  for dtype in (None, "float32"):
    config, params = convert.load_hf_params(ckpt("llada", "bfloat16", 3), dtype=dtype, progress=False)
    want = expected_params("llada", config, raw_tensors(ckpt("llada", "bfloat16", 3)))
    assert_trees_equal(params, jax.tree.map(lambda x: x.astype(config.param_dtype), want) if dtype else want)


def test_import_casts_to_requested_dtype(ckpt):
  hf_dir = ckpt("dream", "bfloat16", 3)
  config, params = convert.load_hf_params(hf_dir, dtype="float32", progress=False)
  assert (config.param_dtype, config.dtype) == ("float32", "float32")
  want = jax.tree.map(lambda x: np.asarray(x, np.float32), expected_params("dream", config, raw_tensors(hf_dir)))
  assert_trees_equal(params, want)


def test_config_roundtrip_and_embedding_size():
  for cfg in (LLADA_8B, DREAM_7B, TINY_LLADA, TINY_DREAM):
    for kind in ("bidirectional", "block_causal", "causal"):  # (a preset's None is read back as 'bidirectional')
      assert convert.config_from_hf(convert.hf_config_from_model(cfg.replace(attention_kind=kind))) == \
          cfg.replace(attention_kind=kind)
  hf = convert.hf_config_from_model(TINY_LLADA)
  hf.update(vocab_size=500, embedding_size=512)  # padded embedding rows: the embedding has 512 rows
  assert convert.config_from_hf(hf).vocab_size == 512
  hf = convert.hf_config_from_model(LLADA_8B)
  for field in ("mask_token_id", "eos_token_id", "pad_token_id", "bos_token_id"):
    del hf[field]
  cfg = convert.config_from_hf(hf)  # token ids fall back to the released model's
  assert (cfg.mask_token_id, cfg.eos_token_id, cfg.pad_token_id, cfg.bos_token_id, cfg.eot_token_id) == \
      (126336, 126081, 126081, 126080, 126348)


# --- round trip -------------------------------------------------------------------------------------

@pytest.mark.parametrize("family,dtype,shards", [("llada", "bfloat16", 3), ("dream", "float32", 1),
                                                 ("dream", "bfloat16", 2)])
def test_hf_orbax_hf_is_bit_identical(ckpt, tmp_path, family, dtype, shards):
  hf_dir = ckpt(family, dtype, shards)
  conv, back = tmp_path / "conv", tmp_path / "back"
  convert.convert_hf_dir(hf_dir, conv, progress=False)
  assert convert.is_converted_dir(conv) and not convert.is_converted_dir(hf_dir)
  convert.export_converted(conv, back, max_shard_bytes=40_000)
  assert os.path.exists(back / "model.safetensors.index.json")  # re-sharded, which must not matter
  original, exported = raw_tensors(hf_dir), raw_tensors(back)
  assert sorted(original) == sorted(exported)
  for name in original:
    assert_same_bits(exported[name], original[name], name)
  for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
    assert (back / name).read_bytes() == open(os.path.join(hf_dir, name), "rb").read(), name


def test_restore_converted_numpy_dtype_and_sharded_target(ckpt, tmp_path):
  hf_dir = ckpt("llada", "float32", 1)
  config, params = convert.load_hf_params(hf_dir, progress=False)
  convert.save_converted(tmp_path / "c", config, params, source_dir=hf_dir)
  got_cfg, got, lora_cfg, lora_params = convert.restore_converted(tmp_path / "c")
  assert got_cfg == config and lora_cfg is None and lora_params is None
  assert_trees_equal(got, params)
  cfg16, got16, _, _ = convert.restore_converted(tmp_path / "c", dtype="bfloat16")
  assert cfg16.param_dtype == "bfloat16"
  assert_trees_equal(got16, jax.tree.map(lambda x: x.astype(BF16), params))
  mesh = jax.make_mesh((1,), ("x",))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), params)
  _, on_mesh, _, _ = convert.restore_converted(tmp_path / "c", target=target)
  leaves = jax.tree.leaves(on_mesh)
  assert all(isinstance(x, jax.Array) and x.sharding == sharding for x in leaves)
  assert_trees_equal(jax.tree.map(np.asarray, on_mesh), params)


def _as_version_1(conv, old):
  """A copy of converted directory `conv` as format version 1 wrote it: q / k / v [L, E, heads, D], o [L, H, D, E]
  and LoRA b of q / k / v [L, r, heads, D], a of o [L, H, D, r] (written here by hand, not by the converter)."""
  from d2f_jax.convert import checkpoint
  meta = json.loads((conv / "d2f_model.json").read_text())
  cfg = meta["config"]
  H, K, D = cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"]
  heads = {"q": H, "k": K, "v": K}
  shutil.copytree(conv, old)
  for part in ("params", "lora"):
    if not (conv / part).exists():
      continue
    saved = {leaf: shape for leaf, (shape, _) in checkpoint.tree_metadata(str(conv / part)).items()}
    tree = checkpoint.restore_tree(str(conv / part), saved)
    layers = tree["layers"]
    for name, x in list(layers.items()):
      target, _, ab = name.partition("_lora_")
      if target in heads and ab in ("", "b"):
        layers[name] = x.reshape(*x.shape[:2], heads[target], D)
      elif target == "o" and ab in ("", "a"):
        layers[name] = x.reshape(x.shape[0], H, D, x.shape[-1])
    shutil.rmtree(old / part)
    checkpoint.save_tree(str(old / part), tree)
  meta["version"] = 1
  (old / "d2f_model.json").write_text(json.dumps(meta))


def test_a_version_1_directory_reads_and_exports_in_todays_layout(ckpt, tmp_path):
  """Converted directories written before heads were packed with head_dim are reshaped on restore: the same
  parameters (numpy and onto a mesh), the same exported HF tensors and PEFT adapter, bit for bit."""
  hf_dir = ckpt("dream", "float32", 1)  # Dream: q / k / v biases too, and GQA (k, v narrower than q)
  adapter = synthetic.write_peft_adapter(tmp_path / "adapter", TINY_DREAM,
                                         LoraConfig(rank=4, alpha=8, targets=("q", "k", "v", "o", "up")), seed=5)
  conv, old = tmp_path / "conv", tmp_path / "old"
  convert.convert_hf_dir(hf_dir, conv, lora_dir=adapter, progress=False)
  assert json.loads((conv / "d2f_model.json").read_text())["version"] == 2
  _as_version_1(conv, old)
  from d2f_jax.convert.checkpoint import tree_metadata
  c = TINY_DREAM
  assert tree_metadata(str(old / "params"))["layers/o"][0] == (c.num_layers, c.num_heads, c.head_dim, c.embed_dim)
  cfg_new, new, lora_cfg, lora_new = convert.restore_converted(conv)
  cfg_old, got, lora_cfg_old, lora_got = convert.restore_converted(old)
  assert (cfg_old, lora_cfg_old) == (cfg_new, lora_cfg)
  assert_trees_equal(got, new)
  assert_trees_equal(lora_got, lora_new)
  sharding = jax.sharding.NamedSharding(jax.make_mesh((1,), ("x",)), jax.sharding.PartitionSpec())
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, BF16, sharding=sharding), {**new, "layers": {
      **new["layers"], **lora_new["layers"]}})
  _, on_mesh, _, lora_on_mesh = convert.restore_converted(old, target=target)
  assert all(x.sharding == sharding for x in jax.tree.leaves(on_mesh) + jax.tree.leaves(lora_on_mesh))
  assert_trees_equal(jax.tree.map(np.asarray, on_mesh), jax.tree.map(lambda x: x.astype(BF16), new))
  assert_trees_equal(jax.tree.map(np.asarray, lora_on_mesh), jax.tree.map(lambda x: x.astype(BF16), lora_new))
  convert.export_converted(old, tmp_path / "back", lora_out=tmp_path / "adapter_back")
  original, exported = raw_tensors(hf_dir), raw_tensors(tmp_path / "back")
  assert sorted(original) == sorted(exported)
  for name in original:
    assert_same_bits(exported[name], original[name], name)
  a, b = raw_tensors(adapter), raw_tensors(tmp_path / "adapter_back")
  assert sorted(a) == sorted(b) and all(a[n].tobytes() == b[n].tobytes() for n in a)


def test_converted_dir_keeps_tokenizer_loadable(ckpt, tmp_path):
  import transformers
  hf_dir = ckpt("dream", "float32", 1)
  convert.convert_hf_dir(hf_dir, tmp_path / "c", progress=False)
  tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "c"), local_files_only=True,
                                                   trust_remote_code=False)
  assert tok("w5 w7")["input_ids"] == [5, 7]
  assert tok.convert_tokens_to_ids(tok.mask_token) == TINY_DREAM.mask_token_id
  assert tok.eos_token_id == TINY_DREAM.eos_token_id


# --- refusals ---------------------------------------------------------------------------------------

def _rewrite(src, dst, edit_tensors=None, edit_config=None):
  """Copy a checkpoint as one model.safetensors, editing its tensors dict / config dict."""
  os.makedirs(dst)
  tensors = raw_tensors(src)
  if edit_tensors:
    edit_tensors(tensors)
  d2f_safetensors.save_file(os.path.join(dst, "model.safetensors"), tensors, {"format": "pt"})
  hf = json.load(open(os.path.join(src, "config.json")))
  if edit_config:
    edit_config(hf)
  json.dump(hf, open(os.path.join(dst, "config.json"), "w"))
  return str(dst)


def test_missing_unexpected_and_misshaped_tensors(ckpt, tmp_path):
  src = ckpt("llada")
  name = "model.transformer.blocks.1.up_proj.weight"
  bad = _rewrite(src, tmp_path / "missing", lambda t: t.pop(name))
  with pytest.raises(convert.CheckpointError, match=f"missing 1 tensor.*{name}"):
    convert.load_hf_params(bad, progress=False)
  extra = "model.transformer.blocks.0.rotary.cache"
  bad = _rewrite(src, tmp_path / "extra", lambda t: t.update({extra: np.zeros(3, np.float32)}))
  with pytest.raises(convert.CheckpointError, match=f"1 unexpected tensor.*{extra} \\(in model.safetensors\\)"):
    convert.load_hf_params(bad, progress=False)
  name = "model.transformer.blocks.0.q_proj.weight"
  bad = _rewrite(src, tmp_path / "shape", lambda t: t.update({name: np.zeros((64, 60), np.float32)}))
  with pytest.raises(convert.CheckpointError,
                     match=rf"{name}' in model.safetensors has shape \[64, 60\], expected \[64, 64\]"):
    convert.load_hf_params(bad, progress=False)


def test_other_family_names_give_a_hint(ckpt, tmp_path):
  llada_cfg = json.load(open(os.path.join(ckpt("llada"), "config.json")))
  bad = _rewrite(ckpt("dream"), tmp_path / "mix", edit_config=lambda c: (c.clear(), c.update(llada_cfg)))
  with pytest.raises(convert.CheckpointError, match="names are those of a dream checkpoint but config.json says llada"):
    convert.load_hf_params(bad, progress=False)


def test_config_errors(ckpt, tmp_path):
  bad = _rewrite(ckpt("llada"), tmp_path / "type", edit_config=lambda c: c.update(model_type="llama"))
  with pytest.raises(ConfigError, match="unknown model_type 'llama'; known: 'llada'.*'Dream'"):
    convert.load_hf_params(bad, progress=False)
  bad = _rewrite(ckpt("llada"), tmp_path / "field", edit_config=lambda c: c.pop("d_model"))
  with pytest.raises(ConfigError, match=r"field/config.json: missing field 'd_model'"):
    convert.load_hf_params(bad, progress=False)
  bad = _rewrite(ckpt("dream"), tmp_path / "dfield", edit_config=lambda c: c.pop("intermediate_size"))
  with pytest.raises(ConfigError, match="missing field 'intermediate_size'"):
    convert.load_hf_params(bad, progress=False)
  os.makedirs(tmp_path / "noconfig")
  with pytest.raises(FileNotFoundError, match="has no config.json"):
    convert.load_hf_params(tmp_path / "noconfig", progress=False)


def test_pickle_only_dir_refused_unless_allowed(ckpt):
  hf_dir = ckpt("dream", "bfloat16", 1, fmt="pickle")
  assert not any(n.endswith(".safetensors") for n in os.listdir(hf_dir))
  with pytest.raises(convert.CheckpointError, match="only PyTorch pickle weights.*pytorch_model.bin.*allow_pickle"):
    convert.load_hf_params(hf_dir, progress=False)
  _, from_pickle = convert.load_hf_params(hf_dir, allow_pickle=True, progress=False)
  _, from_safetensors = convert.load_hf_params(ckpt("dream", "bfloat16", 1), progress=False)
  assert_trees_equal(from_pickle, from_safetensors)


def test_corrupt_files_and_bad_index(ckpt, tmp_path):
  bad = tmp_path / "corrupt"
  shutil.copytree(ckpt("llada"), bad)
  (bad / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
  with pytest.raises(SafetensorsError, match="model.safetensors: header length 16 does not fit"):
    convert.load_hf_params(bad, progress=False)
  (bad / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{bad}    ")
  with pytest.raises(SafetensorsError, match="not valid JSON.*corrupt header"):
    convert.load_hf_params(bad, progress=False)
  sharded = tmp_path / "sharded"
  shutil.copytree(ckpt("llada", "float32", 3), sharded)
  index = json.load(open(sharded / "model.safetensors.index.json"))
  index["weight_map"]["model.transformer.blocks.9.q_proj.weight"] = "model-00002-of-00003.safetensors"
  json.dump(index, open(sharded / "model.safetensors.index.json", "w"))
  with pytest.raises(SafetensorsError, match="blocks.9.q_proj.weight' is listed for model-00002-of-00003.safetensors "
                                             "but absent"):
    convert.load_hf_params(sharded, progress=False)
  os.remove(sharded / "model-00003-of-00003.safetensors")
  with pytest.raises(FileNotFoundError, match="model-00003-of-00003.safetensors"):
    convert.load_hf_params(sharded, progress=False)


def test_non_empty_out_dir_refused_unless_overwrite(ckpt, tmp_path):
  out = tmp_path / "out"
  out.mkdir()
  (out / "keep.txt").write_text("x")
  with pytest.raises(FileExistsError, match="not empty.*overwrite"):
    convert.convert_hf_dir(ckpt("llada"), out, progress=False)
  assert (out / "keep.txt").exists()
  convert.convert_hf_dir(ckpt("llada"), out, overwrite=True, progress=False)
  assert not (out / "keep.txt").exists() and convert.is_converted_dir(out)
  assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p or ".old-" in p]  # no leftovers


# --- safetensors files against the official package -------------------------------------------------

def test_our_writer_and_reader_agree_with_safetensors_package(tmp_path):
  from safetensors.torch import save_file
  tensors = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": (np.arange(6) / 7).astype(BF16),
             "c": np.array([1, -2], np.int64), "d": np.zeros((0, 3), np.float16)}
  d2f_safetensors.save_file(str(tmp_path / "ours.safetensors"), tensors, {"format": "pt"})
  theirs = load_file(str(tmp_path / "ours.safetensors"))
  assert theirs["b"].dtype == torch.bfloat16 and theirs["c"].dtype == torch.int64
  assert_same_bits(theirs["b"].view(torch.int16).numpy().view(BF16), tensors["b"])
  assert_same_bits(theirs["a"].numpy(), tensors["a"])
  save_file({"w": torch.arange(20, dtype=torch.float32).reshape(5, 4).to(torch.bfloat16)},
            str(tmp_path / "theirs.safetensors"))
  reader = d2f_safetensors.CheckpointReader(str(tmp_path / "theirs.safetensors"))
  full = reader.read("w")
  assert full.dtype == BF16 and full.shape == (5, 4)
  assert_same_bits(reader.read("w", rows=(1, 3)), full[1:3])
  np.testing.assert_array_equal(full.astype(np.float32), np.arange(20, dtype=np.float32).reshape(5, 4))


# --- CLI and benchmark ------------------------------------------------------------------------------

def test_cli_end_to_end_with_lora(ckpt, tmp_path):
  hf_dir = ckpt("llada", "bfloat16", 3)
  adapter = synthetic.write_peft_adapter(tmp_path / "adapter", TINY_LLADA, LoraConfig(rank=4, alpha=8), seed=5)
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
  run = lambda *a: subprocess.run([sys.executable, "-m", "d2f_jax.convert", "--no_progress", *a], cwd=REPO,  # noqa
                                  env=env, capture_output=True, text=True, timeout=120)
  res = run("--hf_dir", hf_dir, "--lora_dir", adapter, "--out", str(tmp_path / "conv"))
  assert res.returncode == 0, res.stderr
  res = run("--to_hf", "--converted", str(tmp_path / "conv"), "--out", str(tmp_path / "back"),
            "--export_lora", str(tmp_path / "adapter_back"))
  assert res.returncode == 0, res.stderr
  original, exported = raw_tensors(hf_dir), raw_tensors(tmp_path / "back")
  assert sorted(original) == sorted(exported)
  assert all(original[n].tobytes() == exported[n].tobytes() for n in original)
  a, b = raw_tensors(adapter), raw_tensors(tmp_path / "adapter_back")
  assert sorted(a) == sorted(b) and all(a[n].tobytes() == b[n].tobytes() for n in a)
  res = run("--hf_dir", hf_dir, "--out", str(tmp_path / "conv"))  # exists, no --overwrite
  assert res.returncode != 0 and "not empty" in res.stderr


def test_bench_convert_tiny(tmp_path):
  from d2f_jax.bench import convert as bench
  out = tmp_path / "bench.json"
  bench.main(["--size_gb", "0.004", "--shards", "2", "--out", str(out), "--workdir", str(tmp_path)])
  result = json.loads(out.read_text())
  assert result["rows"][0]["direction"] == "hf->converted" and len(result["rows"]) == 2
  for row in result["rows"]:
    assert row["seconds"] > 0 and row["peak_rss_gb"] > 0.05
    assert row["ratio"] == pytest.approx(row["peak_rss_gb"] / max(row["largest_shard_gb"], row["output_gb"]))
  assert result["ratio"] == result["rows"][0]["ratio"]
  assert 0.003 < result["rows"][0]["checkpoint_gb"] < 0.02
