"""NaN / inf weights never load, convert, merge or export silently: each is refused naming the tensor and the
first bad index; allow_nonfinite=True (--allow_nonfinite) lets them through, for forensics."""

import json
import os
import struct
import subprocess
import sys

import jax
import numpy as np
import pytest

import d2f_jax
from d2f_jax import convert
from d2f_jax.convert import synthetic
from d2f_jax.convert.errors import ConvertError
from d2f_jax.models import LoraConfig, TINY_LLADA

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = TINY_LLADA.replace(num_layers=1)
LORA = LoraConfig(rank=4, alpha=8.0, targets=("q", "v"))


def poison(path, tensor: str, element: int, value: float) -> None:
  """Overwrite one float32 element of `tensor` in the safetensors file `path`."""
  blob = bytearray(open(path, "rb").read())
  (size,) = struct.unpack("<Q", blob[:8])
  entry = json.loads(blob[8:8 + size])[tensor]
  assert entry["dtype"] == "F32"
  at = 8 + size + entry["data_offsets"][0] + 4 * element
  blob[at:at + 4] = struct.pack("<f", value)
  open(path, "wb").write(bytes(blob))


@pytest.fixture
def hf(tmp_path):
  path = tmp_path / "hf"
  synthetic.write_hf_checkpoint(path, CONFIG, seed=0, dtype="float32")
  return path


def test_a_nan_base_weight_is_refused_at_load_and_convert_naming_tensor_and_index(hf, tmp_path):
  name = "model.transformer.blocks.0.q_proj.weight"
  poison(hf / "model.safetensors", name, 3 * CONFIG.embed_dim + 5, float("nan"))
  with pytest.raises(ConvertError, match=rf"tensor '{name}' holds nan at index \[3, 5\].*allow_nonfinite"):
    d2f_jax.load_model(str(hf))
  model = d2f_jax.load_model(str(hf), allow_nonfinite=True)  # forensics: it loads, NaN and all
  assert any(np.isnan(np.asarray(x)).any() for x in jax.tree.leaves(model.state))
  res = subprocess.run([sys.executable, "-m", "d2f_jax.convert", "--hf_dir", str(hf), "--out", str(tmp_path / "out"),
                        "--no_progress"], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"),
                       capture_output=True, text=True, timeout=120)
  assert res.returncode == 2, res.stderr[-2000:]
  assert f"error: checkpoint '{hf}' (model.safetensors): tensor '{name}' holds nan at index [3, 5]" in res.stderr
  assert not os.path.exists(tmp_path / "out")


def test_an_inf_lora_tensor_is_refused_at_load_and_at_merge(hf, tmp_path):
  adapter = tmp_path / "adapter"
  synthetic.write_peft_adapter(adapter, CONFIG, LORA, seed=1)
  [weights] = [n for n in os.listdir(adapter) if n.endswith(".safetensors")]
  blob = open(adapter / weights, "rb").read()
  (size,) = struct.unpack("<Q", blob[:8])
  name = sorted(k for k in json.loads(blob[8:8 + size]) if "lora_B" in k)[0]
  poison(adapter / weights, name, 2, float("-inf"))
  with pytest.raises(ConvertError, match=rf"tensor '{name}' holds -inf at index \[0, 2\]"):
    convert.read_peft_adapter(str(adapter), CONFIG)
  with pytest.raises(ConvertError, match=rf"tensor '{name}' holds -inf"):
    convert.convert_hf_dir(hf, tmp_path / "merged", lora_dir=adapter, merge=True, progress=False)
  with pytest.raises(ConvertError, match=rf"tensor '{name}' holds -inf"):
    d2f_jax.load_model(str(hf), lora_dir=str(adapter))
  assert not os.path.exists(tmp_path / "merged")


def test_a_converted_directory_with_nan_is_refused_at_load(hf, tmp_path):
  cfg, params = convert.load_hf_params(str(hf), progress=False)
  params["layers"]["down"][0, 1, 2] = np.inf
  out = tmp_path / "converted"
  convert.save_converted(out, cfg, params)
  with pytest.raises(ConvertError, match=r"params: tensor 'layers/down' holds inf at index \[0, 1, 2\]"):
    d2f_jax.load_model(str(out))


def test_the_trainers_export_refuses_non_finite_weights(tmp_path):
  from d2f_jax.train.model import export_student
  from test_robust_train import tiny_config
  from d2f_jax.train.trainer import Trainer
  trainer = Trainer(tiny_config(), str(tmp_path / "work"))
  try:
    params = jax.tree.map(np.array, jax.device_get(trainer.state.params))
    params["layers"]["q_lora_b"][1, 0, 0] = np.nan
    with pytest.raises(ConvertError, match=r"tensor 'layers/q_lora_b' holds nan at index \[1, 0, 0\].*Nothing was exported"):
      export_student(str(tmp_path / "adapter"), trainer.models, params)
    assert not os.path.exists(tmp_path / "adapter")
  finally:
    trainer.close()
