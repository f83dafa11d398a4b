"""Model directories that used to load wrong without a word: sizes in config.json far beyond the tensors, a
tokenizer larger than the embedding, a directory holding two checkpoints, a symlink loop. Each is now a
refusal naming the file and the values."""

import json
import os
import resource
import subprocess
import sys

import pytest

import d2f_jax
from d2f_jax import convert
from d2f_jax.convert import synthetic
from d2f_jax.convert.errors import ConvertError
from d2f_jax.models import TINY_LLADA

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = TINY_LLADA.replace(num_layers=1)


@pytest.fixture
def hf(tmp_path):
  path = tmp_path / "hf"
  synthetic.write_hf_checkpoint(path, CONFIG, seed=0, dtype="float32")
  return path


def _limit_memory():
  resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))  # the old convert grew past 15 GB


def test_config_sizes_far_beyond_the_tensors_are_refused_before_any_work_scales_with_them(hf, tmp_path):
  raw = json.loads((hf / "config.json").read_text())
  raw["n_layers"] = 10 ** 12
  (hf / "config.json").write_text(json.dumps(raw))
  res = subprocess.run([sys.executable, "-m", "d2f_jax.convert", "--hf_dir", str(hf), "--out", str(tmp_path / "out"),
                        "--no_progress"], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"),
                       capture_output=True, text=True, timeout=120, preexec_fn=_limit_memory)
  assert res.returncode == 2, res.stderr[-2000:]
  [line] = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
  assert "config.json" in line and "num_layers=1000000000000" in line and "headers hold" in line, line
  with pytest.raises(ConvertError, match=r"num_layers=1000000000000"):
    d2f_jax.load_model(str(hf))


def test_a_tokenizer_larger_than_the_embedding_is_refused_naming_both_sizes(hf):
  synthetic.write_tokenizer(str(hf), CONFIG.replace(vocab_size=CONFIG.vocab_size + 100))
  with pytest.raises(ValueError, match=rf"tokenizer in '{hf}' has {CONFIG.vocab_size + 100} tokens.*embedding "
                                       rf"has {CONFIG.vocab_size} rows"):
    d2f_jax.load_model(str(hf))


def test_a_directory_with_a_converted_and_a_hf_checkpoint_is_refused_unless_one_is_chosen(hf, tmp_path):
  both = tmp_path / "both"
  convert.convert_hf_dir(hf, both, progress=False)
  for name in ("model.safetensors", "config.json"):
    (both / name).write_bytes((hf / name).read_bytes())
  with pytest.raises(ConvertError, match=r"holds both a converted model \(d2f_model.json\) and a Hugging Face "
                                         r"checkpoint \(model.safetensors\).*format='converted' or format='hf'"):
    d2f_jax.load_model(str(both))
  assert d2f_jax.load_model(str(both), format="hf").config == d2f_jax.load_model(str(both), format="converted").config
  with pytest.raises(ConvertError, match=r"holds both a converted model"):
    convert.convert_hf_dir(both, tmp_path / "again", progress=False)


def test_a_self_referencing_safetensors_symlink_is_reported_as_a_loop(hf):
  os.remove(hf / "model.safetensors")
  os.symlink("model.safetensors", hf / "model.safetensors")
  with pytest.raises(OSError, match=rf"{hf}/model.safetensors is a symlink loop"):
    d2f_jax.load_model(str(hf))
  os.symlink("loop", hf.parent / "loop")
  with pytest.raises(OSError, match=rf"{hf.parent}/loop is a symlink loop"):
    d2f_jax.load_model(str(hf.parent / "loop"))
