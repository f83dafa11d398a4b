"""The product's programs through the compile-tier CLI (`python -m d2f_jax.aot`) with the real compilers: the
sharded train step (distill, LoRA, remat, micro batches) with the Pallas flash kernels, and the whole jitted D2F
and AR decode loops and the serving engine's advance / insert programs with the Pallas window kernel, for both
families at --quick size on v5e-8 and v5p-8 (libtpu)
and 8xh100 (CUDA plugin). Each report must say the program compiled and fits; the compiler's dump must show the
project's kernels inside each sharded program (Mosaic custom calls on TPU, sm_90a PTX entries on H100).

Also: a real target whose compiler is not in this venv exits 2 saying how to install it, never compiling on a
CPU stand-in (the CPU venv's version of this is tests/test_aot.py), and D2F_ACCEL_REQUIRED=1 turns a missing
compiler into a failure (the guard of .ci/run, so the tier cannot pass by skipping).
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
from accel_evidence import FLASH_KERNELS, WINDOW_KERNELS, device_modules, has_compiler, module_kernels

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIGS = ("configs/llada_8b.py", "configs/dream_7b.py")
PROGRAMS = ("train", "d2f_decode", "ar_decode", "serve")
REPORTS = ("train", "d2f_decode", "ar_decode", "serve_advance", "serve_insert")  # serve compiles two programs
TARGETS = {  # target: (marker, platform, devices, device kind, train mesh, PTX target or None)
    "v5e-8": ("tpu", "tpu", 8, "TPU v5 lite", "data=2,fsdp=2,tensor=2", None),
    "v5p-8": ("tpu", "tpu", 4, "TPU v5", "data=1,fsdp=2,tensor=2", None),
    "8xh100": ("cuda", "cuda", 8, "NVIDIA H100 80GB HBM3", "data=2,fsdp=2,tensor=2", "sm_90a"),
}


def _aot(args, env_extra=None, timeout=600):
  env = dict(os.environ, **(env_extra or {}))
  return subprocess.run([sys.executable, "-m", "d2f_jax.aot", *args], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=timeout)


def _mesh(text):
  return {k: int(v) for k, v in (part.split("=") for part in text.split(","))}


@pytest.mark.parametrize("target", [pytest.param(t, marks=getattr(pytest.mark, spec[0]))
                                    for t, spec in TARGETS.items()])
def test_train_and_decode_compile_and_fit_with_pallas_kernels(target, tmp_path):
  _, platform, n_devices, device_kind, mesh, ptx_target = TARGETS[target]
  results, stdout, dumps = [], "", []
  for i, config in enumerate(CONFIGS):  # one --config per run, each with its own dump (module ids restart)
    out, dump = tmp_path / f"aot{i}.json", tmp_path / f"dump{i}"
    args = ["--target", target, "--quick", "--mesh", mesh, "--batch", "2", "--slots", "4", "--json", str(out),
            "--config", config]
    for program in PROGRAMS:
      args += ["--program", program]
    proc = _aot(args, {"XLA_FLAGS": f"--xla_dump_to={dump}"})
    log = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, log
    results += json.loads(out.read_text())["results"]
    stdout += proc.stdout
    dumps += [(dump, module) for module in device_modules(dump, platform)]
  assert [(r["model"], r["program"]) for r in results] == [
      (m, p) for m in ("tiny-llada", "tiny-dream") for p in REPORTS], log
  for r in results:
    assert (r["platform"], r["devices"], r["device_kind"], r["attention_impl"]) == (
        platform, n_devices, device_kind, "pallas"), r
    assert r["fits"] is True and r["compiled"]["total"] == r["needed_bytes"] > 0, r
    if platform == "tpu":  # (8, 128) tiles pad tiny arrays: at least the declared per-device bytes
      assert r["compiled"]["arguments"] >= r["argument_bytes"] and r["compiled"]["generated_code"] > 0, r
    else:  # exactly the declared per-device bytes: nothing replicated by accident
      assert abs(r["compiled"]["arguments"] - r["argument_bytes"]) < 1024, r
    if r["program"] == "train":
      assert r["mesh"] == _mesh(mesh) and r["compiled"]["aliased"] > 0, r  # the state is donated
    elif r["program"].endswith("_decode"):
      assert r["shape"]["rows_compiled"] % r["mesh"]["data"] == 0, r
  assert stdout.count(": fits;") == len(results), stdout[-4000:]

  assert len(dumps) == len(results), f"{len(results)} programs but accelerator modules {dumps}"
  for (dump, (module_id, name)), r in zip(dumps, results):
    kernels, targets = module_kernels(dump, platform, module_id)
    want = FLASH_KERNELS if r["program"] == "train" else WINDOW_KERNELS
    if r["program"] == "serve_insert":  # the prefill and first step only: some of the window kernels
      assert kernels and kernels <= want, f"{r['model']} insert (module {module_id} {name}): {sorted(kernels)}"
    else:
      assert kernels == want, f"{r['model']} {r['program']} (module {module_id} {name}): kernels {sorted(kernels)}"
    if ptx_target:
      assert targets == {ptx_target}, f"{r['model']} {r['program']}: PTX targets {sorted(targets)}"
  for dump in {d for d, _ in dumps}:
    shutil.rmtree(dump)  # tens of MB per target


@pytest.mark.parametrize("target,install,marker", [
    pytest.param("8xh100", "d2f_jax[cuda12]", "cuda", marks=pytest.mark.tpu),
    pytest.param("a100", "d2f_jax[cuda12]", "cuda", marks=pytest.mark.tpu),
    pytest.param("v5e-8", "d2f_jax[tpu]", "tpu", marks=pytest.mark.cuda),
    pytest.param("v5p-8", "d2f_jax[tpu]", "tpu", marks=pytest.mark.cuda),
])
def test_a_target_whose_compiler_is_in_the_other_venv_exits_2(target, install, marker):
  if has_compiler(marker):
    pytest.skip(f"this venv has the {marker} compiler too")  # not the case in either venv of .ci/accel_venvs.sh
  proc = _aot(["--target", target, "--config", "configs/llada_8b.py", "--program", "d2f_decode"], timeout=120)
  assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
  error = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
  assert len(error) == 1 and install in error[0], proc.stderr[-2000:]
  assert "lowered" not in proc.stdout and "compiled" not in proc.stdout  # nothing ran on a stand-in


@pytest.mark.parametrize("absent", [pytest.param("cuda", marks=pytest.mark.tpu),
                                    pytest.param("tpu", marks=pytest.mark.cuda)])
def test_required_turns_a_missing_compiler_into_a_failure(absent, tmp_path):
  """pytest on one test of the absent compiler: skipped normally, failed under D2F_ACCEL_REQUIRED=1."""
  if has_compiler(absent):
    pytest.skip(f"this venv has the {absent} compiler too")
  node = "tests/accel/test_accel_kernels.py::test_the_backend_compiler_refuses_tiles_that_lower_fine"
  outcomes = {}
  for value in ("0", "1"):
    env = dict(os.environ, D2F_ACCEL_REQUIRED=value)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", absent,
                           "--basetemp", str(tmp_path / value), node], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    outcomes[value] = (proc.returncode, proc.stdout[-1500:])
  assert outcomes["0"][0] == 0 and "1 skipped" in outcomes["0"][1], outcomes["0"][1]
  assert outcomes["1"][0] == 1 and "1 error" in outcomes["1"][1], outcomes["1"][1]
  assert "D2F_ACCEL_REQUIRED=1" in outcomes["1"][1] and "missing" in outcomes["1"][1], outcomes["1"][1]


@pytest.mark.parametrize("target", [pytest.param("v5e-8", marks=pytest.mark.tpu),
                                    pytest.param("8xh100", marks=pytest.mark.cuda)])
def test_llada2_train_decode_and_serve_compile_and_fit(target, tmp_path):
  """The mixture-of-experts family (tiny-llada2: experts as one grouped matmul, split over the tensor axis)
  through the same programs: the distillation step, the D2F decode loop and the engine's programs compile with
  the real compiler and fit."""
  _, platform, n_devices, _, mesh, _ = TARGETS[target]
  out = tmp_path / "aot.json"
  args = ["--target", target, "--quick", "--mesh", mesh, "--batch", "2", "--slots", "4", "--json", str(out),
          "--config", "configs/llada_8b.py", "--config.model.preset=llada2-mini"]
  for program in ("train", "d2f_decode", "serve"):
    args += ["--program", program]
  proc = _aot(args)
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
  results = json.loads(out.read_text())["results"]
  assert [(r["model"], r["program"]) for r in results] == [
      ("tiny-llada2", p) for p in ("train", "d2f_decode", "serve_advance", "serve_insert")], results
  for r in results:
    assert (r["platform"], r["devices"]) == (platform, n_devices) and r["fits"] is True, r
