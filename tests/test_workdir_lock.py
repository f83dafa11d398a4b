"""One writer per workdir: a second training, main job or convert into a directory a live process works in is
refused naming that process; a lock left by a killed process is taken over with a warning; every orderly
exit lets go of the lock."""

import json
import os
import socket
import subprocess
import sys

import pytest

from d2f_jax import workdir_lock
from d2f_jax.workdir_lock import WorkdirLocked

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")


@pytest.fixture
def holder():
  """Start a process that holds the lock of a directory until the test ends; yields a function doing it."""
  procs = []

  def start(directory, beside=False):
    code = (f"from d2f_jax import workdir_lock; import sys, time; workdir_lock.acquire({str(directory)!r}, "
            f"beside={beside}); print('locked', flush=True); sys.stdin.read()")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=ENV, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    procs.append(proc)
    return proc.pid
  yield start
  for proc in procs:
    proc.kill()
    proc.wait()


def test_a_second_training_in_a_busy_workdir_is_refused_naming_the_other_process(tmp_path, holder):
  from test_robust_train import tiny_config
  from d2f_jax.train.trainer import Trainer
  pid = holder(tmp_path)
  with pytest.raises(WorkdirLocked, match=rf"training workdir {tmp_path} is in use by process {pid} on host "
                                          rf"{socket.gethostname()}"):
    Trainer(tiny_config(), str(tmp_path))
  assert sorted(os.listdir(tmp_path)) == [workdir_lock.LOCK_NAME]  # nothing of the workdir written


def test_the_distill_cli_refuses_a_busy_workdir_with_one_error_line_exit_2(tmp_path, holder):
  pid = holder(tmp_path)
  res = subprocess.run([sys.executable, "-m", "d2f_jax.distill", f"--config={ROOT}/configs/tiny.py:runlocal",
                        f"--workdir={tmp_path}"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
  assert res.returncode == 2, res.stderr[-2000:]
  [line] = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
  assert f"in use by process {pid} on host {socket.gethostname()}" in line and "Traceback" not in res.stderr


def test_a_stale_lock_of_a_dead_process_is_taken_over_with_a_warning(tmp_path, caplog):
  dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
  pid = int(dead.stdout)
  path = workdir_lock.lock_file(tmp_path)
  with open(path, "w") as f:
    json.dump({"pid": pid, "host": socket.gethostname(), "since": "then", "argv": ["old"]}, f)
  with caplog.at_level("WARNING"), workdir_lock.hold(tmp_path) as held:
    assert held == path and json.load(open(path))["pid"] == os.getpid()
  assert f"its process {pid} on {socket.gethostname()}" in caplog.text and "taking over the lock" in caplog.text
  assert not os.path.exists(path)  # released at the block's end


def test_another_hosts_lock_is_refused_saying_which_file_to_delete(tmp_path):
  path = workdir_lock.lock_file(tmp_path)
  with open(path, "w") as f:
    json.dump({"pid": 1234, "host": "elsewhere-host", "since": "then"}, f)
  with pytest.raises(WorkdirLocked, match=rf"process 1234 on host elsewhere-host.*delete {path}"):
    workdir_lock.acquire(tmp_path)


def test_the_lock_is_released_when_the_trainer_fails_and_when_it_closes(tmp_path, monkeypatch):
  from test_robust_train import tiny_config
  from d2f_jax.train.trainer import Trainer

  def fail(self):
    raise FileNotFoundError("no model here")
  with monkeypatch.context() as patch:
    patch.setattr(Trainer, "_setup_models", fail)
    with pytest.raises(FileNotFoundError):
      Trainer(tiny_config(), str(tmp_path / "a"))
  assert not os.path.exists(workdir_lock.lock_file(tmp_path / "a"))
  trainer = Trainer(tiny_config(), str(tmp_path / "b"))
  assert os.path.exists(workdir_lock.lock_file(tmp_path / "b"))
  trainer.close()
  assert not os.path.exists(workdir_lock.lock_file(tmp_path / "b"))


def test_the_main_job_and_convert_refuse_a_busy_directory(tmp_path, holder):
  from d2f_jax.convert import pipeline as convert_pipeline, synthetic
  from d2f_jax.e2e import pipeline
  from d2f_jax.models import TINY_LLADA
  from test_e2e import _config
  pid = holder(tmp_path / "main")
  with pytest.raises(WorkdirLocked, match=rf"main job workdir .*main is in use by process {pid}"):
    pipeline.run(_config("smoke"), str(tmp_path / "main"))
  assert sorted(os.listdir(tmp_path / "main")) == [workdir_lock.LOCK_NAME]
  hf = tmp_path / "hf"
  synthetic.write_hf_checkpoint(hf, TINY_LLADA.replace(num_layers=1), seed=0, dtype="float32", tokenizer=False)
  pid = holder(tmp_path / "out", beside=True)
  with pytest.raises(WorkdirLocked, match=rf"convert output .*out is in use by process {pid}"):
    convert_pipeline.convert_hf_dir(hf, tmp_path / "out", progress=False)
  assert not os.path.exists(tmp_path / "out")
