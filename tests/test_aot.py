"""The ahead-of-time compile check: topology names, argument errors, a quick compile of both families' train
steps on 8 fake CPU devices (memory table + JSON), and a full-size LLaDA-8B lowering that never holds the
weights (the child's peak RSS stays far below the 16 GB they would take)."""

import json
import os
import subprocess
import sys

import pytest

from d2f_jax import aot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLADA = "configs/llada_8b.py:tpu_v5p_64"
DREAM = "configs/dream_7b.py:tpu_v5p_64"
MESH8 = "data=2,fsdp=2,tensor=2"


@pytest.mark.parametrize("name,kind,chips,tpu_name", [
    ("v5p-64", "v5p", 32, "v5p:2x4x4"), ("v5p-8", "v5p", 4, "v5p:2x2x1"), ("v4-32", "v4", 16, "v4:2x2x4"),
    ("v5p-256", "v5p", 128, "v5p:4x4x8"), ("v5e-64", "v5e", 64, "v5e:8x8"), ("v5litepod-16", "v5e", 16, "v5e:4x4"),
    ("v6e-8", "v6e", 8, "v6e:2x4"), ("v5e-1", "v5e", 1, "v5e:1x1"), ("v5p:4x4x4", "v5p", 64, "v5p:4x4x4"),
    ("8xh100", "h100", 8, None), ("2x8xh100", "h100", 16, None), ("8xa100", "a100-40g", 8, None),
    ("4xa100-80g", "a100-80g", 4, None), ("8xh200", "h200", 8, None),
])
def test_topologies(name, kind, chips, tpu_name):
  topo = aot.parse_topology(name)
  assert (topo.kind, topo.chips, topo.tpu_name) == (kind, chips, tpu_name)
  assert topo.kind in aot.HBM_GIB


@pytest.mark.parametrize("name", ["v5p-12", "v5p-4", "v5e-2", "v7-8", "tpu", "8xv100"])
def test_bad_topologies_are_named(name):
  with pytest.raises(ValueError, match="topology"):
    aot.parse_topology(name)


@pytest.mark.parametrize("argv,message", [
    (["--config", LLADA, "--topology", "v5p-64", "--mesh", MESH8], "needs 8 devices, the target has 32"),
    (["--config", LLADA, "--topology", "v9-8"], "unknown topology"),
    (["--config", LLADA, "--mesh", "data=2,model=4"], "--mesh"),
    (["--config", "configs/nope.py"], "does not exist"),
    (["--config", LLADA, "--model", "gpt-5"], "neither a preset"),
    (["--config", LLADA, "--set", "optim.lr"], "FIELD=VALUE"),
    (["--config", "configs/llada_8b.py:cpu"], "-1 axis; pass --topology or --devices"),
    (["--config", LLADA, "--backend", "tpu"], "--backend tpu needs a TPU --topology"),
    (["--config", "configs/llada_8b.py:cpu", "--devices", "6", "--mesh", "data=4,fsdp=-1"], "does not divide 6"),
])
def test_argument_errors_exit_2_with_a_message(argv, message, capsys, monkeypatch):
  monkeypatch.chdir(ROOT)
  with pytest.raises(SystemExit) as e:
    aot.main(argv)
  assert e.value.code == 2
  assert message in capsys.readouterr().err


def test_tpu_backend_without_libtpu_explains(capsys, monkeypatch):
  monkeypatch.chdir(ROOT)
  monkeypatch.setattr(aot, "libtpu_available", lambda: False)
  with pytest.raises(SystemExit) as e:
    aot.main(["--config", LLADA, "--topology", "v5p-64", "--backend", "tpu"])
  assert e.value.code == 2
  assert "libtpu is not installed" in capsys.readouterr().err


def _run(args):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  return subprocess.run([sys.executable, "-m", "d2f_jax.aot", *args], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=300)


def test_quick_check_of_both_families_on_eight_fake_devices(tmp_path):
  out = tmp_path / "aot.json"
  proc = _run(["--config", LLADA, "--config", DREAM, "--quick", "--mesh", MESH8, "--json", str(out)])
  assert proc.returncode == 0, proc.stdout + proc.stderr
  text = proc.stdout
  assert "device      HBM GiB" in text and "<- target" in text
  for kind in aot.HBM_GIB:
    assert f"\n{kind:<10} " in text
  results = json.loads(out.read_text())["results"]
  assert [r["family"] for r in results] == ["llada", "dream"]
  for r in results:
    assert r["devices"] == 8 and r["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2} and r["backend"] == "cpu"
    assert r["target"] == "v5p" and r["fits_target"] is True
    compiled, analytic = r["compiled"], r["analytic"]
    assert compiled["total"] > 0 and compiled["temporaries"] > 0 and analytic["activations"] > 0
    # The abstract state, frozen weights and batch are exactly what the compiled program takes per device.
    expected_args = sum(analytic[k] for k in ("frozen_weights", "trainable", "optimizer", "batch"))
    assert abs(compiled["arguments"] - expected_args) < 1024, (compiled, analytic)
    assert compiled["aliased"] > 0  # the donated state is reused for the new one
    assert r["largest_arrays"]


def test_full_size_llada_lowers_without_allocating_the_weights(tmp_path):
  out = tmp_path / "aot.json"
  proc = _run(["--config", LLADA, "--mesh", "data=1,fsdp=8,tensor=1", "--device", "v5e", "--no_compile",
               "--require_fit", "--json", str(out)])
  assert proc.returncode == 3, proc.stdout + proc.stderr  # lowered, but does not fit a 16 GiB v5e
  r = json.loads(out.read_text())["results"][0]
  assert r["model"] == "llada-8b" and r["params"]["frozen"] > 8e9 and r["compiled"] is None
  assert r["fits_target"] is False
  assert r["analytic"]["frozen_weights"] == pytest.approx(2 * r["params"]["frozen"] / 8, rel=0.01)  # bf16 / 8
  peak = r["host_peak_rss_bytes"]  # 8B bf16 weights alone would be 16 GB
  assert peak is not None and peak < 4 * 2 ** 30, f"peak RSS {peak / 2 ** 30:.1f} GiB"


def test_in_process_call_re_executes_with_the_device_count(tmp_path, capfd, monkeypatch):
  import jax
  assert jax.device_count() == 1  # this process's JAX is up already with one device
  monkeypatch.chdir(ROOT)
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  out = tmp_path / "aot.json"
  status = aot.main(["--config", LLADA, "--quick", "--no_compile", "--mesh", MESH8, "--json", str(out)])
  assert status == 0, capfd.readouterr()
  assert json.loads(out.read_text())["results"][0]["devices"] == 8
