"""launch/: every command the scripts would run, from their --dry-run output, and clear errors for bad
arguments. Nothing here calls gcloud, creates a venv or needs a GPU."""

import os
import shlex
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASH = shutil.which("bash")
TPU = os.path.join(ROOT, "launch", "tpu_pod.sh")
GPU = os.path.join(ROOT, "launch", "gpu_host.sh")
BASE_TPU = ["--name", "d2f-llada", "--zone", "us-east5-a", "--accelerator", "v5p-64"]
DISTILL = ["--config", "configs/llada_8b.py:tpu_v5p_64", "--workdir", "/mnt/runs/llada"]


def run(script, *args, env=None, cwd=ROOT):
  return subprocess.run([BASH, script, *args], capture_output=True, text=True, timeout=60, cwd=cwd,
                        env=env if env is not None else os.environ)


def commands(proc) -> list[list[str]]:
  """The printed commands ('+ cmd args...', shell-quoted) as argv lists."""
  assert proc.returncode == 0, proc.stderr
  return [shlex.split(line[2:]) for line in proc.stdout.splitlines() if line.startswith("+ ")]


def find(cmds, *words) -> int:
  hits = [i for i, c in enumerate(cmds) if all(w in c for w in words)]
  assert len(hits) == 1, (words, cmds)
  return hits[0]


def option(cmd, name) -> str:
  values = [a.split("=", 1)[1] for a in cmd if a.startswith(name + "=")]
  assert len(values) == 1, (name, cmd)
  return values[0]


# --- tpu_pod.sh ---------------------------------------------------------------------------------------

def test_tpu_pod_dry_run_creates_installs_runs_everywhere_collects_and_deletes():
  extra = ["--config.model.path=/mnt/ckpt/LLaDA-8B-Instruct", "--config.data.path=/mnt/data/q a.jsonl"]
  cmds = commands(run(TPU, *BASE_TPU, *DISTILL, "--project", "my-proj", "--spot", "--dry-run", "--", *extra))
  gc = ["gcloud", "compute", "tpus", "tpu-vm"]
  create = find(cmds, "create")
  assert cmds[create][:6] == gc + ["create", "d2f-llada"]
  for flag in ("--zone=us-east5-a", "--project=my-proj", "--accelerator-type=v5p-64", "--version=v2-alpha-tpuv5",
               "--spot"):
    assert flag in cmds[create]
  tar = find(cmds, "tar")
  assert "--exclude=.venv*" in cmds[tar] and cmds[tar][-3:] == ["-C", ROOT, "."]
  copy = find(cmds, "scp", "--worker=all")
  setup = [i for i, c in enumerate(cmds) if c[:5] == gc + ["ssh"] and "pip install" in option(c, "--command")]
  assert len(setup) == 1 and "--worker=all" in cmds[setup[0]]
  assert 'pip install -q ~/d2f_jax"[tpu,eval]"' in option(cmds[setup[0]], "--command")
  job = [i for i, c in enumerate(cmds) if c[:5] == gc + ["ssh"] and "d2f_jax.distill" in option(c, "--command")]
  assert len(job) == 1
  remote = option(cmds[job[0]], "--command")
  assert "--worker=all" in cmds[job[0]] and "--zone=us-east5-a" in cmds[job[0]]
  job_argv = shlex.split(remote.split("{", 1)[1].split(";", 1)[0])
  assert job_argv == ["python", "-m", "d2f_jax.distill", "--config=configs/llada_8b.py:tpu_v5p_64",
                      "--workdir=/mnt/runs/llada", *extra]
  assert "tee ~/d2f_logs/" in remote and "PIPESTATUS" in remote
  logs = [i for i, c in enumerate(cmds) if c[:5] == gc + ["scp"] and c[5].startswith("d2f-llada:")]
  assert [option(cmds[i], "--worker") for i in logs] == [str(w) for w in range(8)]  # v5p-64: 8 hosts
  delete = find(cmds, "delete")
  assert cmds[delete][:6] == gc + ["delete", "d2f-llada"] and "--quiet" in cmds[delete]
  assert create < tar < copy < setup[0] < job[0] < logs[0] < delete == len(cmds) - 1


def test_tpu_pod_git_install_command_mode_v5e_alias_and_keep():
  proc = run(TPU, "--name", "d2f-eval", "--zone", "us-west4-a", "--accelerator", "v5e-16", "--git",
             "https://github.com/d2f-jax/d2f_jax", "--ref", "v0.1",
             "--command", "python -m d2f_jax.evaluate --task gsm8k",
             "--keep", "--dry-run")
  cmds = commands(proc)
  assert "--accelerator-type=v5litepod-16" in cmds[0] and "--version=v2-alpha-tpuv5-lite" in cmds[0]
  install = option(cmds[1], "--command")
  assert shlex.split(install.split("pip install -q ")[-1]) == [
      "d2f_jax[tpu,eval] @ git+https://github.com/d2f-jax/d2f_jax@v0.1"]
  assert "--worker=all" in cmds[1]
  assert not any("tar" in c for c in cmds)
  assert "{ python -m d2f_jax.evaluate --task gsm8k ; }" in option(cmds[2], "--command")
  assert sum(c[4:5] == ["scp"] for c in cmds) == 4  # v5litepod-16: 4 hosts
  assert not any("delete" in c for c in cmds)
  assert "--keep" in proc.stderr and "delete d2f-eval" in proc.stderr


@pytest.mark.parametrize("args,message", [
    (["--zone", "us-east5-a", "--accelerator", "v5p-64", *DISTILL], "--name is required"),
    (["--name", "D2F", "--zone", "us-east5-a", "--accelerator", "v5p-64", *DISTILL], "is not a valid TPU name"),
    (["--name", "a", "--zone", "useast", "--accelerator", "v5p-64", *DISTILL], "does not look like a zone"),
    (["--name", "a", "--zone", "us-east5-a", "--accelerator", "a100-8", *DISTILL], "is not a TPU type"),
    (["--name", "a", "--zone", "us-east5-a", "--accelerator", "v5p-12", *DISTILL], "powers of two"),
    (["--name", "a", "--zone", "us-east5-a", "--accelerator", "v6e-2", *DISTILL], "sizes are 1, 4, 8"),
    ([*BASE_TPU], "nothing to run"),
    ([*BASE_TPU, *DISTILL, "--command", "ls"], "not both"),
    ([*BASE_TPU, "--config", "configs/llada_8b.py"], "--config needs --workdir"),
    ([*BASE_TPU, "--config", "configs/nope.py", "--workdir", "/w"], "'configs/nope.py' not found"),
    ([*BASE_TPU, "--command", "ls", "--", "--x=1"], "put them inside --command"),
    ([*BASE_TPU, *DISTILL, "--src", "/nonexistent"], "is not a directory"),
    ([*BASE_TPU, *DISTILL, "--frobnicate"], "unknown argument '--frobnicate'"),
    ([*BASE_TPU, *DISTILL, "--zone"], "--zone needs a value"),
])
def test_tpu_pod_rejects_bad_arguments(args, message):
  proc = run(TPU, *args, "--dry-run")
  assert proc.returncode == 2 and proc.stdout == ""
  assert message in proc.stderr and "--help" in proc.stderr


def _path_without(tmp_path, *tools):
  """A PATH holding only what the scripts use besides the tools named (gcloud, nvidia-smi)."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  for tool in ("dirname", "python3"):
    target = shutil.which(tool)
    if target and tool not in tools:
      (bin_dir / tool).symlink_to(target)
  return dict(os.environ, PATH=str(bin_dir))


def test_tpu_pod_without_gcloud_says_so(tmp_path):
  proc = run(TPU, *BASE_TPU, *DISTILL, env=_path_without(tmp_path, "gcloud"))
  assert proc.returncode == 2 and "gcloud is not installed" in proc.stderr and proc.stdout == ""


def test_help():
  for script in (TPU, GPU):
    proc = run(script, "--help")
    assert proc.returncode == 0 and proc.stdout.startswith("usage:")


# --- gpu_host.sh --------------------------------------------------------------------------------------

def test_gpu_host_single_host_distill():
  cmds = commands(run(GPU, "--config", "configs/llada_8b.py:gpu_8xh100", "--workdir", "/data/runs/llada", "--gpus",
                      "0,1,2,3", "--dry-run", "--", "--config.model.path=/data/ckpt"))
  venv = os.path.join(os.path.expanduser("~"), "d2f_venv")
  assert cmds[0] == ["python3", "-m", "venv", venv]
  assert cmds[find(cmds, "install", "-e")][-2:] == ["-e", ROOT + "[cuda12,eval]"]  # the package's own extras
  assert ["export", "CUDA_VISIBLE_DEVICES=0,1,2,3"] in cmds
  assert not any(c[0] == "export" and c[1].startswith("JAX_COORDINATOR") for c in cmds)
  job = cmds[-1]
  assert job[:7] == [os.path.join(venv, "bin", "python"), "-m", "d2f_jax.distill",
                     "--config=configs/llada_8b.py:gpu_8xh100", "--workdir=/data/runs/llada",
                     "--config.model.path=/data/ckpt", "2>&1"]
  assert job[-2:] == ["tee", os.path.join(ROOT, "logs", "gpu", "host-0.log")]


def test_gpu_host_multi_host_starts_jax_distributed(tmp_path):
  cmds = commands(run(GPU, "--config", "configs/llada_8b.py:gpu_2x8xh100", "--workdir", "/nfs/runs", "--num_hosts",
                      "2", "--host_index", "1", "--coordinator", "10.0.0.1:12355", "--cuda", "13", "--skip_install",
                      "--logs", str(tmp_path), "--dry-run"))
  assert not any("pip" in c for c in cmds)
  for pair in ("JAX_COORDINATOR_ADDRESS=10.0.0.1:12355", "JAX_NUM_PROCESSES=2", "JAX_PROCESS_ID=1"):
    assert ["export", pair] in cmds
  job = cmds[-1]
  assert job[1:4] == [os.path.join(ROOT, "launch", "jax_distributed.py"), "-m", "d2f_jax.distill"]
  assert job[-1] == str(tmp_path / "host-1.log")


def test_gpu_host_eval_and_command_modes():
  job = commands(run(GPU, "--eval", "--skip_install", "--dry-run", "--", "--model", "/m", "--task", "gsm8k"))[-1]
  assert job[1:7] == ["-m", "d2f_jax.evaluate", "--model", "/m", "--task", "gsm8k"]
  job = commands(run(GPU, "--command", "nvidia-smi && echo ok", "--skip_install", "--dry-run"))[-1]
  assert job[:3] == ["bash", "-c", "nvidia-smi && echo ok"]


@pytest.mark.parametrize("args,message", [
    ([], "exactly one of"),
    (["--eval", "--command", "ls"], "exactly one of"),
    (["--config", "configs/llada_8b.py"], "--config needs --workdir"),
    (["--config", "configs/nope.py", "--workdir", "/w"], "not found"),
    (["--eval"], "--eval needs the evaluation flags"),
    (["--command", "ls", "--", "-x"], "inside --command"),
    (["--eval", "--cuda", "11", "--", "--task", "gsm8k"], "--cuda must be 12 or 13"),
    (["--eval", "--gpus", "0;1", "--", "--task", "gsm8k"], "--gpus must be"),
    (["--eval", "--num_hosts", "2", "--", "--task", "gsm8k"], "needs --host_index"),
    (["--eval", "--num_hosts", "2", "--host_index", "2", "--coordinator", "h:1", "--", "-x"],
     "--host_index must be in"),
    (["--eval", "--num_hosts", "2", "--host_index", "0", "--", "-x"], "needs --coordinator"),
    (["--eval", "--num_hosts", "2", "--host_index", "0", "--coordinator", "h", "--", "-x"], "HOST:PORT"),
    (["--eval", "--num_hosts", "0", "--", "-x"], "positive integer"),
    (["--eval", "--host_index", "1", "--", "-x"], "need --num_hosts > 1"),
    (["--eval", "--retries", "-1", "--", "-x"], "--retries must be a non-negative integer"),
])
def test_gpu_host_rejects_bad_arguments(args, message):
  proc = run(GPU, *args, "--dry-run")
  assert proc.returncode == 2 and proc.stdout == ""
  assert message in proc.stderr and "--help" in proc.stderr


def test_gpu_host_without_a_gpu_driver_says_so(tmp_path):
  proc = run(GPU, "--eval", "--", "--task", "gsm8k", env=_path_without(tmp_path, "nvidia-smi"))
  assert proc.returncode == 2 and "nvidia-smi not found" in proc.stderr


def test_jax_distributed_wrapper_initialises_then_runs_the_module(tmp_path):
  (tmp_path / "probe_module.py").write_text(textwrap.dedent("""
      import sys, jax
      print("probe", jax.distributed.is_initialized(), jax.process_count(), sys.argv[1:])
  """))
  wrapper = os.path.join(ROOT, "launch", "jax_distributed.py")
  env = dict(os.environ, PYTHONPATH=str(tmp_path), JAX_PLATFORMS="cpu", JAX_NUM_PROCESSES="1", JAX_PROCESS_ID="0")
  env.pop("JAX_COORDINATOR_ADDRESS", None)
  proc = subprocess.run([sys.executable, wrapper, "-m", "probe_module", "--a", "1"], env=env, capture_output=True,
                        text=True, timeout=60)
  assert proc.returncode != 0 and "JAX_COORDINATOR_ADDRESS" in proc.stderr
  import socket
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  env["JAX_COORDINATOR_ADDRESS"] = f"127.0.0.1:{port}"
  proc = subprocess.run([sys.executable, wrapper, "-m", "probe_module", "--a", "1"], env=env, capture_output=True,
                        text=True, timeout=60)
  assert proc.returncode == 0, proc.stderr
  assert "probe True 1 ['--a', '1']" in proc.stdout


def _fake_gpu_host(tmp_path):
  """PATH with a stand-in nvidia-smi, so the script runs its job for real (no install, no GPU)."""
  bin_dir = tmp_path / "fakebin"
  bin_dir.mkdir(exist_ok=True)
  (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
  (bin_dir / "nvidia-smi").chmod(0o755)
  return dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def test_gpu_host_reruns_a_preempted_job_until_it_finishes(tmp_path):
  """Exit 143 is distill's "preempted, checkpoint saved": the script reruns the job (which resumes)."""
  marks = tmp_path / "runs"
  job = f"echo run >> {marks}; [ $(wc -l < {marks}) -ge 3 ] && exit 0; exit 143"
  proc = run(GPU, "--command", job, "--skip_install", "--logs", str(tmp_path / "logs"), env=_fake_gpu_host(tmp_path))
  assert proc.returncode == 0, proc.stderr
  assert marks.read_text().split() == ["run"] * 3
  assert "resuming, retry 1 of 3" in proc.stderr and "resuming, retry 2 of 3" in proc.stderr
  # Out of retries: the job's 143 is the script's status.
  marks.unlink()
  proc = run(GPU, "--command", f"echo run >> {marks}; exit 143", "--skip_install", "--retries", "1",
             "--logs", str(tmp_path / "logs"), env=_fake_gpu_host(tmp_path))
  assert proc.returncode == 143 and marks.read_text().split() == ["run"] * 2
  # Any other failure is not retried.
  marks.unlink()
  proc = run(GPU, "--command", f"echo run >> {marks}; exit 3", "--skip_install", "--logs", str(tmp_path / "logs"),
             env=_fake_gpu_host(tmp_path))
  assert proc.returncode == 3 and marks.read_text().split() == ["run"]


def test_gpu_host_stopped_by_sigterm_stops_its_job_and_does_not_rerun(tmp_path):
  import time
  from process_utils import sigterm_when_ready
  started = tmp_path / "started"
  job = f"trap 'echo got-term >> {started}; exit 143' TERM; echo up >> {started}; while :; do sleep 0.1; done"
  proc = subprocess.Popen([BASH, GPU, "--command", job, "--skip_install", "--logs", str(tmp_path / "logs")],
                          env=_fake_gpu_host(tmp_path), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)

  def ready():
    deadline = time.time() + 30
    while not (started.exists() and "up" in started.read_text()) and time.time() < deadline:
      time.sleep(0.1)
  err = sigterm_when_ready(proc, ready, timeout=30)
  assert proc.returncode == 143, err
  assert started.read_text().split() == ["up", "got-term"]  # the job got the signal, and ran once
  assert "resuming" not in err
