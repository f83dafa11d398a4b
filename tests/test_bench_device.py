"""`bench device`: it refuses a CPU with one `error:` line (exit 2), and with the accelerator check mocked it
measures every program of a tiny shape on this CPU and prints each beside the projection of the target the
mocked device kind names (formula always; compiled where a cost cache holds the program)."""

import json
import os
import subprocess
import sys

from d2f_jax.bench import cost, device

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_cpu_is_refused_with_one_error_line_and_exit_2():
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  proc = subprocess.run([sys.executable, "-m", "d2f_jax.bench", "device"], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and "GPU or TPU" in errors[0] and "'cpu'" in errors[0], proc.stderr[-2000:]
  assert proc.stdout == ""  # nothing measured


def test_device_kinds_map_to_cost_targets():
  assert device.target_for("NVIDIA H100 80GB HBM3", 1) == ("h100", "H100 SXM")
  assert device.target_for("NVIDIA H200", 1) == ("h100", "H200")  # the H100's programs, the H200's bandwidth
  assert device.target_for("NVIDIA A100-SXM4-80GB", 8) == ("8xa100", "A100 80GB")
  assert device.target_for("TPU v5 lite", 8) == ("v5e-8", "TPU v5e")
  assert device.target_for("TPU v5", 4) == ("v5p-8", "TPU v5p")
  assert device.target_for("Some NPU", 1) == (None, "")


def test_mocked_device_measures_each_program_beside_its_projection(tmp_path, monkeypatch, capsys):
  monkeypatch.setattr(device, "accelerator", lambda: "NVIDIA H100 80GB HBM3")
  # A compiled cost for one program, as `bench cost --target h100` caches it.
  shape = dict(kind="ar_step", batch=1, prompt=32, new_tokens=32, block_size=8, width=1)
  entry = {"model": "tiny-llada", "cache_len": 64, "shape": shape, "mesh": {"data": 1, "fsdp": 1, "tensor": 1},
           "device_kind": "NVIDIA H100 80GB HBM3",
           "compiled": {"flops": 2e6, "bytes": 3e6, "opaque": ["__gpu$xla.gpu.triton"],
                        "kernel": {"flops": 1.0, "bytes": 1e5}}}
  (tmp_path / "costs").mkdir()
  (tmp_path / "costs" / "h100.json").write_text(json.dumps({cost.cache_key("h100", "tiny-llada", shape): entry}))
  out = tmp_path / "device.json"
  status = device.main(["--tiny", "--model", "tiny-llada", "--widths", "1,2", "--batch", "1,2", "--repeats", "2",
                        "--cost_cache", str(tmp_path / "costs"), "--workdir", str(tmp_path / "no_models"),
                        "--out", str(out)])
  assert status == 0
  printed = capsys.readouterr().out
  assert "NVIDIA H100 80GB HBM3" in printed and "target h100 priced on H100 SXM" in printed
  report = json.loads(out.read_text())
  rows = report["rows"]
  assert [(r["program"], r["width"], r["batch"]) for r in rows] == [
      (kind, width, batch) for batch in (1, 2)
      for kind, width in (("d2f_step", 1), ("d2f_step", 2), ("ar_step", ""), ("d2f_prefill", ""), ("ar_prefill", ""))]
  for r in rows:
    assert float(r["measured ms"]) > 0 and float(r["projected ms (formula)"]) > 0
    assert float(r["measured / formula"]) > 0
  with_compiled = [r for r in rows if r["projected ms (compiled)"] != "-"]
  assert [(r["program"], r["batch"]) for r in with_compiled] == [("ar_step", 1)]
  assert report["target"] == "h100" and report["e2e"] == [] and report["skipped"] == []


def test_the_budget_stops_starting_programs(tmp_path, monkeypatch):
  monkeypatch.setattr(device, "accelerator", lambda: "TPU v5 lite")
  out = tmp_path / "device.json"
  assert device.main(["--tiny", "--model", "tiny-dream", "--widths", "1", "--batch", "1", "--repeats", "1",
                      "--budget_s", "0", "--workdir", str(tmp_path), "--out", str(out)]) == 0
  report = json.loads(out.read_text())
  assert report["rows"] == [] and len(report["skipped"]) == 4 and report["target"] == "v5e-1"


def test_packaged_compiled_costs_are_of_this_cost_version():
  """`bench device` prints the packaged compiled costs beside its measurements: a package whose programs or
  accounting changed since (a stale COST_VERSION) would print numbers no longer true of the code."""
  import pathlib
  from d2f_jax.bench.cost import compiled as cost_compile
  folder = pathlib.Path(device.__file__).parent / "compiled_costs"
  files = sorted(folder.glob("*.json"))
  assert files, folder
  for path in files:
    keys = json.loads(path.read_text())
    assert keys and all(k.split("|")[1] == f"v{cost_compile.COST_VERSION}" for k in keys), path


def test_the_projection_drops_compiled_bytes_when_a_sibling_program_shows_them_implausible(tmp_path):
  """bench cost's rule, applied where the device's numbers are compared: one program of the same model and
  cache with bytes under its weights (libtpu's count did this) and the compiled column uses the formula's."""
  from d2f_jax import datasheets
  from d2f_jax.bench.cost import model as cm
  from d2f_jax.decode.forward_probes import StepShape
  from d2f_jax.models import preset
  config = preset("tiny-llada", dtype="bfloat16", param_dtype="bfloat16")
  mesh = {"data": 1, "fsdp": 1, "tensor": 1}
  floor, sheet = cm.weights_per_device(config, mesh), datasheets.by_name("TPU v5e")
  shapes = [dict(kind="ar_step", batch=b, prompt=32, new_tokens=32, block_size=8, width=1) for b in (1, 2)]
  step = StepShape(**shapes[0])

  def projected(sibling_bytes):
    entries = {cost.cache_key("v5e-1", "tiny-llada", s): {
        "model": "tiny-llada", "cache_len": 64, "shape": s, "mesh": mesh,
        "compiled": {"flops": 1e3, "bytes": nbytes, "opaque": []}} for s, nbytes in zip(shapes, (3 * floor, sibling_bytes))}
    (tmp_path / "v5e-1.json").write_text(json.dumps(entries))
    return device.projected("v5e-1", sheet, "tiny-llada", config, step, mesh, [str(tmp_path)])

  assert projected(4 * floor)["compiled"] == cm.milliseconds({"flops": 1e3, "bytes": 3 * floor}, sheet)
  formula_bytes = cm.formula_cost(config, step, mesh)["bytes"]
  assert projected(-1.0)["compiled"] == cm.milliseconds({"flops": 1e3, "bytes": formula_bytes}, sheet)
  assert formula_bytes != 3 * floor  # the two cases differ
