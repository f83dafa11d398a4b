"""Bad checkpoints, bad configs and interrupted conversions: each refused with an error naming the file and
the field (exit status 2 from the CLI, one line, no traceback), the source and any earlier output intact."""

import json
import os
import shutil
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

from d2f_jax import convert
from d2f_jax.convert import cli, synthetic, util
from d2f_jax.convert.errors import ConvertError
from d2f_jax.models import TINY_LLADA, LoraConfig
from process_utils import sigterm_when_ready

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
  return synthetic.write_hf_checkpoint(tmp_path_factory.mktemp("src") / "llada", TINY_LLADA, seed=3)


@pytest.fixture
def hf(source, tmp_path):
  """A private copy of the tiny checkpoint, to corrupt."""
  return shutil.copytree(source, tmp_path / "hf")


def snapshot(path) -> dict:
  """{relative path: bytes} of a directory, to prove it unchanged."""
  out = {}
  for root, _, files in os.walk(path):
    for name in files:
      full = os.path.join(root, name)
      out[os.path.relpath(full, path)] = open(full, "rb").read()
  return out


def split_file(path):
  raw = open(path, "rb").read()
  (n,) = struct.unpack("<Q", raw[:8])
  return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_file(path, header, data):
  body = json.dumps(header).encode()
  body += b" " * (-len(body) % 8)
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(body)) + body + data)


def edit_config(hf_dir, **changes):
  path = os.path.join(hf_dir, "config.json")
  cfg = json.load(open(path))
  cfg.update(changes)
  json.dump(cfg, open(path, "w"))


def run_cli(capsys, *argv) -> tuple[int, str]:
  """(exit status, stderr) of the convert CLI run in-process."""
  try:
    cli.main(["--no_progress", *map(str, argv)])
    code = 0
  except SystemExit as e:
    code = e.code
  return code, capsys.readouterr().err


def assert_one_line_error(err: str, *parts: str):
  lines = [line for line in err.splitlines() if line.strip()]
  assert len(lines) == 1 and lines[0].startswith("error: "), err
  assert "Traceback" not in err
  for part in parts:
    assert part in lines[0], (part, lines[0])


# --- safetensors headers -----------------------------------------------------------------------

def test_shifted_data_offsets_are_refused_naming_file_and_tensor(hf, tmp_path, capsys):
  path = os.path.join(hf, WEIGHTS)
  header, data = split_file(path)
  for entry in header.values():
    if isinstance(entry, dict) and "data_offsets" in entry:
      entry["data_offsets"] = [o + 4 for o in entry["data_offsets"]]
  write_file(path, header, data + b"\0" * 4)  # still fits the file: only the tiling check catches it
  before = snapshot(hf)
  with pytest.raises(ConvertError,
                     match=r"model.safetensors: tensor '.*' bytes \[4, .*leave a gap after the start"):
    convert.load_hf_params(hf, progress=False)
  code, err = run_cli(capsys, "--hf_dir", hf, "--out", tmp_path / "out")
  assert code == 2
  assert_one_line_error(err, "model.safetensors", "invalid data_offsets")
  assert snapshot(hf) == before and not os.path.exists(tmp_path / "out")


def test_two_tensors_on_the_same_bytes_are_refused(hf):
  path = os.path.join(hf, WEIGHTS)
  header, data = split_file(path)
  names = [n for n in header if n != "__metadata__"]
  a, b = "model.transformer.blocks.0.attn_norm.weight", "model.transformer.blocks.0.ff_norm.weight"
  assert a in names and b in names
  header[b]["data_offsets"] = list(header[a]["data_offsets"])  # same shape, same bytes
  write_file(path, header, data)
  with pytest.raises(ConvertError, match=r"model.safetensors: tensor '.*' bytes .* overlap"):
    convert.load_hf_params(hf, progress=False)


def test_library_validation_is_wrapped_with_the_file_name(hf, monkeypatch):
  """Where our own checks pass, the safetensors library still has the last word, and its refusal names the file."""
  from d2f_jax.convert.safetensors import read
  monkeypatch.setattr(read, "_check_tiling", lambda *a: None)
  path = os.path.join(hf, WEIGHTS)
  header, data = split_file(path)
  for entry in header.values():
    if isinstance(entry, dict) and "data_offsets" in entry:
      entry["data_offsets"] = [o + 4 for o in entry["data_offsets"]]
  write_file(path, header, data + b"\0" * 4)
  with pytest.raises(ConvertError, match=r"model.safetensors: refused by the safetensors library: .*invalid offset"):
    convert.load_hf_params(hf, progress=False)


def test_relabelled_dtype_is_refused_before_a_model_is_built(hf):
  path = os.path.join(hf, WEIGHTS)
  header, data = split_file(path)
  for entry in header.values():
    if isinstance(entry, dict) and entry.get("dtype") == "F32":
      entry["dtype"] = "I32"  # same byte size: the header stays consistent
  write_file(path, header, data)
  with pytest.raises(convert.CheckpointError, match=r"tensor '.*' in model.safetensors has dtype int32, expected "
                                                    r"float32 \(config.json torch_dtype\)"):
    convert.load_hf_params(hf, progress=False)
  edit_config(hf, torch_dtype=None)  # with no declared dtype, an int tensor is still no weight
  with pytest.raises(convert.CheckpointError, match="has dtype int32, expected a floating-point dtype"):
    convert.load_hf_params(hf, progress=False)


def test_weights_in_another_dtype_than_config_json_declares(hf):
  edit_config(hf, torch_dtype="bfloat16")
  with pytest.raises(convert.CheckpointError, match="has dtype float32, expected bfloat16"):
    convert.load_hf_params(hf, progress=False)


# --- config.json ----------------------------------------------------------------------------------

@pytest.mark.parametrize("changes, field, why", [
    (dict(mask_token_id=99999), "mask_token_id", r"99999 is not a token id of the vocabulary \[0, 512\)"),
    (dict(eos_token_id=-5), "eos_token_id", r"-5 is not a token id"),
    (dict(pad_token_id=[600]), "pad_token_id", "600 is not a token id"),
    (dict(eos_token_id="1"), "eos_token_id", "must be an integer token id"),
    (dict(rope_theta="abc"), "rope_theta", "must be a finite number > 0, got 'abc'"),
    (dict(n_kv_heads="four"), "n_kv_heads", "must be a positive integer, got 'four'"),
    (dict(mlp_hidden_size=[160]), "mlp_hidden_size", r"must be a positive integer, got \[160\]"),
    (dict(n_layers=2.0), "n_layers", "must be a positive integer, got 2.0"),
    (dict(weight_tying="no"), "weight_tying", "must be true or false"),
    (dict(torch_dtype="float64"), "torch_dtype", "must be one of"),
    (dict(n_kv_heads=3), None, "num_heads .4. must be a multiple of num_kv_heads .3."),
])
def test_config_json_fields_are_type_checked(hf, tmp_path, capsys, changes, field, why):
  edit_config(hf, **changes)
  with pytest.raises(convert.hf_config.ConfigError, match=why) as exc:
    convert.load_hf_params(hf, progress=False)
  assert "config.json" in str(exc.value) and (field is None or f"'{field}'" in str(exc.value))
  code, err = run_cli(capsys, "--hf_dir", hf, "--out", tmp_path / "out")
  assert code == 2 and not os.path.exists(tmp_path / "out")
  assert_one_line_error(err, "config.json")


def test_missing_token_id_default_outside_a_small_vocab_is_named(hf):
  path = os.path.join(hf, "config.json")
  cfg = json.load(open(path))
  del cfg["mask_token_id"]
  json.dump(cfg, open(path, "w"))
  with pytest.raises(ConvertError, match=r"'mask_token_id' = 126336 \(the released llada default.*\[0, 512\)"):
    convert.read_hf_config(hf)


def test_config_json_that_is_a_list_exits_2_without_traceback(hf, tmp_path):
  with open(os.path.join(hf, "config.json"), "w") as f:
    json.dump([{"model_type": "llada"}], f)
  res = subprocess.run([sys.executable, "-m", "d2f_jax.convert", "--no_progress", "--hf_dir", str(hf), "--out",
                        str(tmp_path / "out")], cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu"),
                       capture_output=True, text=True, timeout=120)
  assert res.returncode == 2, res.stderr
  assert_one_line_error(res.stderr, "config.json", "must be a JSON object", "got list")


# --- d2f_model.json and adapter_config.json -------------------------------------------------------

@pytest.fixture(scope="module")
def converted(source, tmp_path_factory):
  return convert.convert_hf_dir(source, tmp_path_factory.mktemp("conv") / "c", progress=False)


@pytest.mark.parametrize("edit, match", [
    (lambda m: m["config"].update(rope_theta="abc"), r"'config.rope_theta' must be a finite number"),
    (lambda m: m["config"].update(mask_token_id=99999), r"'mask_token_id' = 99999 is not a token id"),
    (lambda m: m["config"].update(num_kv_heads="four"), r"'config.num_kv_heads' must be a positive integer"),
    (lambda m: m["config"].update(colour="red"), r"unknown ModelConfig field\(s\) \['colour'\]"),
    (lambda m: m.update(config=[1, 2]), r"field 'config' must be a JSON object"),
    (lambda m: m.update(lora={"rank": "four"}), r"field 'rank' must be a positive integer, got 'four'"),
])
def test_bad_d2f_model_json_names_file_and_field(converted, tmp_path, capsys, edit, match):
  bad = shutil.copytree(converted, tmp_path / "bad")
  meta_path = os.path.join(bad, "d2f_model.json")
  meta = json.load(open(meta_path))
  edit(meta)
  json.dump(meta, open(meta_path, "w"))
  with pytest.raises(ConvertError, match=match) as exc:
    convert.read_converted_meta(bad)
  assert "d2f_model.json" in str(exc.value)
  code, err = run_cli(capsys, "--to_hf", "--converted", bad, "--out", tmp_path / "back")
  assert code == 2 and not os.path.exists(tmp_path / "back")
  assert_one_line_error(err, "d2f_model.json")


def test_d2f_model_json_not_json(converted, tmp_path):
  bad = shutil.copytree(converted, tmp_path / "bad")
  with open(os.path.join(bad, "d2f_model.json"), "w") as f:
    f.write('{"format": ')
  with pytest.raises(ConvertError, match="d2f_model.json: not valid JSON"):
    convert.read_converted_meta(bad)


@pytest.mark.parametrize("edit, match", [
    (lambda c: c.update(r="four"), r"adapter_config.json: field 'r' must be a positive integer, got 'four'"),
    (lambda c: c.update(lora_alpha="x"), r"adapter_config.json: field 'lora_alpha' must be a finite number"),
    (lambda c: c.update(lora_dropout=1.5), r"adapter_config.json: field 'lora_dropout' must be a finite number"),
    (lambda c: c.update(target_modules=[1]), r"adapter_config.json: target_modules must list module names"),
    (lambda c: c.update(use_rslora="yes"), r"adapter_config.json: field 'use_rslora' must be true or false"),
])
def test_bad_adapter_config_names_file_and_field(source, tmp_path, capsys, edit, match):
  adapter = synthetic.write_peft_adapter(tmp_path / "adapter", TINY_LLADA, LoraConfig(rank=4, alpha=8), seed=1)
  path = os.path.join(adapter, "adapter_config.json")
  cfg = json.load(open(path))
  edit(cfg)
  json.dump(cfg, open(path, "w"))
  with pytest.raises(convert.AdapterError, match=match):
    convert.read_peft_adapter(adapter, TINY_LLADA)
  code, err = run_cli(capsys, "--hf_dir", source, "--lora_dir", adapter, "--out", tmp_path / "out")
  assert code == 2 and not os.path.exists(tmp_path / "out")
  assert_one_line_error(err, "adapter_config.json")


def test_adapter_config_not_json(tmp_path):
  adapter = synthetic.write_peft_adapter(tmp_path / "adapter", TINY_LLADA, LoraConfig(rank=4, alpha=8), seed=1)
  with open(os.path.join(adapter, "adapter_config.json"), "w") as f:
    f.write("[1, 2")
  with pytest.raises(convert.AdapterError, match="adapter_config.json: not valid JSON"):
    convert.read_peft_adapter(adapter, TINY_LLADA)


# --- pickles -------------------------------------------------------------------------------------

class _Evil:
  def __init__(self, marker):
    self.marker = marker

  def __reduce__(self):
    return (os.system, (f"touch {self.marker}",))


def test_allow_pickle_on_a_malicious_pickle_is_one_line_error_and_runs_nothing(source, tmp_path):
  import torch
  bad = tmp_path / "evil"
  os.makedirs(bad)
  shutil.copy(os.path.join(source, "config.json"), bad)
  marker = tmp_path / "pwned"
  torch.save({"model.transformer.wte.weight": _Evil(str(marker))}, bad / "pytorch_model.bin")
  res = subprocess.run([sys.executable, "-m", "d2f_jax.convert", "--no_progress", "--allow_pickle", "--hf_dir",
                        str(bad), "--out", str(tmp_path / "out")], cwd=REPO,
                       env=dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
                       timeout=120)
  assert res.returncode == 2, res.stderr
  assert_one_line_error(res.stderr, "pytorch_model.bin", "weights_only")
  assert not marker.exists() and not (tmp_path / "out").exists()


# --- output directories ----------------------------------------------------------------------------

def test_out_equal_to_inside_or_around_the_source_is_refused(hf, tmp_path, capsys):
  before = snapshot(hf)
  for out, why in ((hf, "is the same directory as --hf_dir"), (os.path.join(hf, "sub"), "lies inside --hf_dir"),
                   (os.path.dirname(hf), "contains --hf_dir")):
    code, err = run_cli(capsys, "--hf_dir", hf, "--out", out, "--overwrite")
    assert code == 2
    assert_one_line_error(err, why)
    assert snapshot(hf) == before
  code, err = run_cli(capsys, "--hf_dir", hf, "--out", tmp_path / "conv")
  assert code == 0, err
  for out in (tmp_path / "conv", tmp_path / "conv" / "hf"):
    code, err = run_cli(capsys, "--to_hf", "--converted", tmp_path / "conv", "--out", out, "--overwrite")
    assert code == 2
    assert_one_line_error(err, "--converted")
  assert convert.is_converted_dir(tmp_path / "conv")


def test_failed_conversion_leaves_no_temp_dir_and_keeps_the_old_output(source, tmp_path, monkeypatch):
  out = tmp_path / "out"
  convert.convert_hf_dir(source, out, progress=False)
  before = snapshot(out)
  from d2f_jax.convert import checkpoint

  def boom(path, tree):
    os.makedirs(path)
    open(os.path.join(path, "partial"), "w").write("x")
    raise OSError("disk full")
  monkeypatch.setattr(checkpoint, "save_tree", boom)
  with pytest.raises(OSError, match="disk full"):
    convert.convert_hf_dir(source, out, overwrite=True, progress=False)
  assert sorted(os.listdir(tmp_path)) == ["out"] and snapshot(out) == before


def test_stale_temp_dirs_of_dead_processes_are_removed_with_a_message(source, tmp_path, caplog):
  dead = subprocess.Popen(["true"])
  dead.wait()  # a pid that no longer runs
  host = util._host()
  stale = tmp_path / f"out.tmp-{host}-{dead.pid}-abc123"
  live = tmp_path / f"out.tmp-{host}-{os.getpid()}-def456"  # a conversion still running: keep
  other_host = tmp_path / f"out.tmp-otherhost-{dead.pid}-ghi789"  # not ours to judge
  for d in (stale, live, other_host):
    os.makedirs(d)
    (d / "blob").write_bytes(b"0" * 1000)
  with caplog.at_level("WARNING"):
    convert.convert_hf_dir(source, tmp_path / "out", progress=False)
  assert not stale.exists() and live.exists() and other_host.exists()
  assert any(str(stale) in r.getMessage() and "no longer runs" in r.getMessage() for r in caplog.records)


_SLOW_CONVERT = """
import sys, time
from d2f_jax.convert import checkpoint, cli
real = checkpoint.save_tree
def slow(path, tree):
  real(path, tree)
  print("saved", flush=True)
  time.sleep(60)
checkpoint.save_tree = slow
cli.main(sys.argv[1:])
"""


def test_sigterm_removes_the_temp_dir_and_exits_143(source, tmp_path):
  out = tmp_path / "out"
  proc = subprocess.Popen([sys.executable, "-c", _SLOW_CONVERT, "--no_progress", "--hf_dir", str(source), "--out",
                           str(out)], cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu"),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

  def ready():
    assert proc.stdout.readline().strip() == "saved"
    assert [p for p in os.listdir(tmp_path) if ".tmp-" in p]  # mid-conversion: the temp dir exists
  err = sigterm_when_ready(proc, ready, timeout=60)
  assert proc.returncode == 143, err
  assert_one_line_error(err, "SIGTERM")
  assert os.listdir(tmp_path) == []


def test_sigkilled_conversion_is_cleaned_by_the_next_run(source, tmp_path):
  out = tmp_path / "out"
  proc = subprocess.Popen([sys.executable, "-c", _SLOW_CONVERT, "--no_progress", "--hf_dir", str(source), "--out",
                           str(out)], cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu"),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    assert proc.stdout.readline().strip() == "saved"
  finally:
    proc.kill()
    proc.communicate(timeout=60)
  left = [p for p in os.listdir(tmp_path) if ".tmp-" in p]
  assert len(left) == 1 and f"-{proc.pid}-" in left[0]
  time.sleep(0.1)
  convert.convert_hf_dir(source, out, progress=False)
  assert os.listdir(tmp_path) == ["out"] and convert.is_converted_dir(out)


def test_converted_weights_still_bit_identical_through_the_library_reader(source):
  """The library-backed reader returns exactly the bytes the safetensors package reads."""
  from safetensors.numpy import load_file
  expected = load_file(os.path.join(source, WEIGHTS))
  with convert.safetensors.CheckpointReader(source) as reader:
    for name, want in expected.items():
      got = reader.read(name)
      assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), name
      if got.ndim and got.shape[0] > 2:
        assert reader.read(name, rows=(1, 3)).tobytes() == want[1:3].tobytes()
  assert np.isfinite(got).all()
