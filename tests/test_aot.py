"""The compile tier's CLI on the CPU: target names, argument errors, the refusal to fall back to the CPU when a
real target's compiler is missing, the train step built by the Trainer's own function (its objective, not
always distill), and the decode loops, compiled on fake CPU devices at tiny size. The real TPU / NVIDIA
compiles are tests/accel/ (run by .ci/run in the accelerator venvs)."""

import json
import os
import subprocess
import sys

import pytest

from d2f_jax import aot
from d2f_jax.aot import cli, programs, topology

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLADA = "configs/llada_8b.py:tpu_v5p_64"
DREAM = "configs/dream_7b.py:tpu_v5p_64"
MESH8 = "data=2,fsdp=2,tensor=2"


@pytest.mark.parametrize("name,kind,chips,platform,tpu_name", [
    ("v5p-64", "v5p", 32, "tpu", "v5p:2x4x4"), ("v5p-8", "v5p", 4, "tpu", "v5p:2x2x1"),
    ("v4-32", "v4", 16, "tpu", "v4:2x2x4"), ("v5e-8", "v5e", 8, "tpu", "v5e:2x4"),
    ("v5litepod-16", "v5e", 16, "tpu", "v5e:4x4"), ("v6e-8", "v6e", 8, "tpu", "v6e:2x4"),
    ("v5e-1", "v5e", 1, "tpu", "v5e:1x1"), ("v5p:4x4x4", "v5p", 64, "tpu", "v5p:4x4x4"),
    ("h100", "h100", 1, "cuda", None), ("8xh100", "h100", 8, "cuda", None), ("2x8xh100", "h100", 16, "cuda", None),
    ("a100", "a100", 1, "cuda", None), ("8xa100-80g", "a100", 8, "cuda", None), ("cpu-8", "cpu", 8, "cpu", None),
])
def test_targets(name, kind, chips, platform, tpu_name):
  t = aot.parse_target(name)
  assert (t.kind, t.chips, t.platform, t.tpu_name) == (kind, chips, platform, tpu_name)
  assert t.usable_bytes == int(aot.HBM_GIB[kind] * 2 ** 30 * aot.USABLE_FRACTION)


@pytest.mark.parametrize("name", ["v5p-12", "v5p-4", "v5e-2", "v7-8", "tpu", "8xv100", "h200"])
def test_bad_targets_are_named(name):
  with pytest.raises(ValueError, match="target"):
    aot.parse_target(name)


def test_gpu_target_descriptions_are_packaged():
  assert 'device_description_str: "NVIDIA H100 80GB HBM3"' in topology.gpu_target_config("h100")
  assert "major: 8" in topology.gpu_target_config("a100")


@pytest.mark.parametrize("argv,message", [
    (["--target", "v9-8", "--config", LLADA], "unknown target"),
    (["--target", "cpu-8", "--config", LLADA, "--mesh", "data=2,model=4"], "--mesh"),
    (["--target", "v5p-8", "--config", LLADA], "does not fit the 4 devices of v5p-8"),
    (["--target", "cpu-8", "--config", "configs/nope.py"], "does not exist"),
    (["--target", "cpu-8", "--config", LLADA, "--config.optim.nope=1"], "--config.optim.nope: the config has no field"),
    (["--target", "cpu-8", "--config", LLADA, "--config.optim.lrr=1"], "did you mean --config.optim.lr?"),
    (["--target", "cpu-8", "--config", LLADA, "--config.optim.lr"], "Missing value for flag --config.optim.lr"),
    (["--target", "cpu-8", "--config", LLADA, "--program", "sample"],
     "one of <train|d2f_decode|ar_decode|llada2_decode|serve|llada2_serve>"),
    (["--target", "cpu-8", "--config", LLADA, "--config", DREAM], "given 2 times: one config per run"),
    (["--target", "cpu-8", "--config", LLADA, "--program", "serve", "--block_cache"], "--block_cache is a setting"),
    (["--config", LLADA], "--target is required"),
])
def test_argument_errors_exit_2_with_a_message(argv, message, capsys, monkeypatch):
  monkeypatch.chdir(ROOT)
  with pytest.raises(SystemExit) as e:
    aot.main(argv)
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err


@pytest.mark.skipif(topology.has_libtpu() or topology.has_cuda_plugin(), reason="an accelerator compiler is here")
@pytest.mark.parametrize("target,install", [("v5p-64", "d2f_jax[tpu]"), ("v5e-8", "d2f_jax[tpu]"),
                                         ("8xh100", "d2f_jax[cuda12]"), ("a100", "d2f_jax[cuda12]")])
def test_a_real_target_without_its_compiler_exits_2_never_compiles_on_cpu(target, install, capsys, monkeypatch):
  monkeypatch.chdir(ROOT)
  with pytest.raises(SystemExit) as e:
    aot.main(["--target", target, "--config", "configs/llada_8b.py", "--program", "d2f_decode"])
  assert e.value.code == 2
  out = capsys.readouterr()
  assert out.err.count("\n") == 1 and out.err.startswith("error: ") and install in out.err, out.err
  assert ".ci/accel_venvs.sh" in out.err and "/work/" not in out.err
  assert "compiled" not in out.out and "lowered" not in out.out  # nothing ran on a CPU stand-in


def test_overrides_are_typed_like_the_field(monkeypatch):
  monkeypatch.chdir(ROOT)
  _, config, model = cli.parse(["--target", "cpu-8", "--config", LLADA, "--config.optim.lr=3e-4",
                                "--config.remat=false", "--config.lora.rank", "8"])
  assert (config.optim.lr, config.remat, config.lora.rank, model) == (3e-4, False, 8, "llada-8b")


@pytest.mark.parametrize("spec,preset", [("configs/llada2_mini.py", "llada2-mini"),
                                         ("configs/llada2_flash.py:tpu_v5p_64", "llada2-flash"),
                                         ("configs/llada_8b.py", "llada-8b"), ("configs/dream_7b.py", "dream-7b")])
def test_a_config_files_name_picks_the_preset_it_distils(spec, preset, monkeypatch):
  """No model.path in a shipped config: the compile check takes the size from the file name (llada2_* before
  the LLaDA family, whose name it contains)."""
  monkeypatch.chdir(ROOT)
  _, config, model = cli.parse(["--target", "cpu-8", "--config", spec])
  assert model == config.model.preset == preset


def test_a_llada2_config_whose_name_has_no_size_is_refused(tmp_path, monkeypatch):
  monkeypatch.chdir(ROOT)
  path = tmp_path / "llada2_tiny.py"
  path.write_text(open(os.path.join(ROOT, "configs", "llada2_mini.py")).read())
  with pytest.raises(cli.usage.UsageError, match=r"names LLaDA2 but not its size .* --config.model.preset"):
    cli.parse(["--target", "cpu-8", "--config", str(path)])


def test_decode_mesh_splits_heads_by_the_largest_power_of_two():
  class MC:
    num_heads = 28  # Dream-7B
  assert programs.decode_mesh_shape(MC, 8) == {"data": 2, "fsdp": 1, "tensor": 4}
  MC.num_heads = 32  # LLaDA-8B
  assert programs.decode_mesh_shape(MC, 8) == {"data": 1, "fsdp": 1, "tensor": 8}
  assert programs.decode_mesh_shape(MC, 1) == {"data": 1, "fsdp": 1, "tensor": 1}


def _run(args, timeout=600):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  return subprocess.run([sys.executable, "-m", "d2f_jax.aot", *args], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=timeout)


def test_quick_train_and_d2f_decode_of_both_families_on_eight_fake_devices(tmp_path):
  results = []
  for i, config in enumerate((LLADA, DREAM)):  # one --config per run
    out = tmp_path / f"aot{i}.json"
    proc = _run(["--target", "cpu-8", "--config", config, "--quick", "--mesh", MESH8,
                 "--program", "train", "--program", "d2f_decode", "--batch", "3", "--json", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results += json.loads(out.read_text())["results"]
  assert [(r["model"], r["program"]) for r in results] == [
      (m, p) for m in ("tiny-llada", "tiny-dream") for p in ("train", "d2f_decode")]
  for r in results:
    assert r["devices"] == 8 and r["platform"] == "cpu" and r["fits"] is True
    compiled = r["compiled"]
    # The compiler takes exactly the abstract inputs' per-device bytes: nothing replicated by accident.
    assert abs(compiled["arguments"] - r["argument_bytes"]) < 1024, r
    assert compiled["temporaries"] > 0 and compiled["total"] == r["needed_bytes"]
  train = [r for r in results if r["program"] == "train"]
  assert all(r["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2} and r["compiled"]["aliased"] > 0 for r in train)
  decode = [r for r in results if r["program"] != "train"]
  for r in decode:  # 3 rows padded up to a multiple of the row shards
    rows = r["shape"]["rows_compiled"]
    assert rows % r["mesh"]["data"] == 0 and 3 <= rows < 3 + r["mesh"]["data"]


@pytest.mark.parametrize("config,program,extra", [(DREAM, "serve", ()), ("configs/llada2_mini.py", "llada2_serve", ()),
                                                  ("configs/llada2_mini.py", "llada2_serve", ("--block_cache",))])
def test_the_serving_engines_programs_compile_sharded_on_four_fake_devices(tmp_path, config, program, extra):
  """--program serve: the engine's advance and insert programs, slots over rows, both reported and fitting;
  llada2_serve the same over LLaDA2's released sampler (tiny-llada2 under --quick), with its block cache or not."""
  out = tmp_path / "serve.json"
  proc = _run(["--target", "cpu-4", "--config", config, "--quick", "--program", program, "--slots", "4",
               "--json", str(out), *extra])
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  results = json.loads(out.read_text())["results"]
  assert [r["program"] for r in results] == [f"{program}_advance", f"{program}_insert"]
  for r in results:
    assert r["fits"] is True and r["devices"] == 4 and r["shape"]["slots"] == 4, r
    assert r["shape"].get("block_cache", False) == bool(extra), r["shape"]
    if r["program"] == "llada2_serve_insert":  # unread weights are pruned from its arguments: every one when it
      # only writes rows, the lm_head when it prefills the block cache (K/V, no logits)
      assert r["compiled"]["arguments"] < r["argument_bytes"] / (1 if extra else 10) - 1024, r
    else:
      assert abs(r["compiled"]["arguments"] - r["argument_bytes"]) < 1024, r  # nothing replicated by accident


def test_train_program_is_the_configs_objective_not_always_distill(monkeypatch):
  """Built through train.step.spec_from_config (the Trainer's): an mdm config has no teacher weights."""
  import jax
  monkeypatch.chdir(ROOT)
  built = {}
  for objective, finetune in (("distill", "lora"), ("mdm", "full")):
    _, config, _ = cli.parse(["--target", "cpu-1", "--config", LLADA, "--quick", f"--config.objective={objective}",
                              f"--config.finetune={finetune}", "--config.mesh.data=1", "--config.mesh.fsdp=1",
                              "--config.batch_size=2", "--config.micro_batches=1"])
    built[objective] = programs.train_program(config, jax.devices("cpu")[:1])
  assert built["distill"].shape["objective"] == "distill" and built["mdm"].shape["objective"] == "mdm"
  state, frozen, _ = built["mdm"].args
  assert frozen == {} and built["distill"].args[1]  # full fine-tune without a teacher: no frozen base
  assert sum(x.size for x in jax.tree.leaves(state.params)) > 4 * sum(
      x.size for x in jax.tree.leaves(built["distill"].args[0].params))  # the whole model vs the LoRA adapter


def test_full_size_decode_lowers_without_weights_and_exits_3_when_it_does_not_fit(tmp_path):
  out = tmp_path / "aot.json"
  proc = _run(["--target", "cpu-1", "--config", "configs/llada_8b.py", "--program", "d2f_decode", "--batch", "1",
               "--no_compile", "--json", str(out)])
  assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]  # 16 GB of bf16 weights > 14.4 GiB
  r = json.loads(out.read_text())["results"][0]
  assert r["model"] == "llada-8b" and r["dtype"] == "bfloat16" and r["compiled"] is None and r["fits"] is False
  assert 15.5e9 < r["argument_bytes"] < 17.5e9, r["argument_bytes"]


def test_in_process_call_re_executes_with_the_device_count(tmp_path, monkeypatch):
  import jax
  assert jax.device_count() == 1  # this process's JAX is up already with one device
  monkeypatch.chdir(ROOT)
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  out = tmp_path / "aot.json"
  status = aot.main(["--target", "cpu-8", "--config", DREAM, "--quick", "--program", "ar_decode", "--batch", "2",
                     "--json", str(out)])
  assert status == 0
  r = json.loads(out.read_text())["results"][0]
  assert (r["devices"], r["program"], r["model"]) == (8, "ar_decode", "tiny-dream")
  assert abs(r["compiled"]["arguments"] - r["argument_bytes"]) < 1024


def test_llada2s_released_sampler_loop_compiles_sharded(tmp_path):
  """--program llada2_decode: the whole jitted loop of method 'llada2' on tiny-llada2, heads over 4 fake devices."""
  out = tmp_path / "llada2.json"
  proc = _run(["--target", "cpu-4", "--config", "configs/llada2_mini.py", "--quick", "--program", "llada2_decode",
               "--batch", "2", "--json", str(out)])
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  (result,) = json.loads(out.read_text())["results"]
  assert result["program"] == "llada2_decode" and result["model"] == "tiny-llada2" and result["fits"] is True
  assert result["mesh"]["tensor"] == 4 and result["shape"]["batch"] == 2
