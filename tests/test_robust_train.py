"""Training against damaged checkpoints, incompatible resumes, divergence and SIGTERM: each recovered or
refused with an error naming the cause, without losing or overwriting what the workdir already holds."""

import json
import os
import shutil
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from d2f_jax.train import config as config_lib
from d2f_jax.train.checkpoint import CheckpointMismatch, CorruptCheckpoints
from d2f_jax.train.config import load_config_file
from d2f_jax.train.state import abstract_state
from d2f_jax.train.divergence import NonFiniteError
from d2f_jax.train.trainer import METRICS_FILE, Trainer
from test_robust_convert import snapshot
from process_utils import sigterm_when_ready

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 8


def tiny_config(**overrides):
  c = load_config_file(os.path.join(ROOT, "configs", "tiny.py") + ":runlocal")
  c.total_steps = STEPS
  c.data.synthetic_examples = 96
  c.data.eval_examples = 8
  c.checkpoint.every = 2
  c.checkpoint.keep = 4
  c.log_every = 1
  c.eval_every = 1000
  c.eval_batches = 1
  c.progress_bar = False
  c.export = False
  c.update_from_flattened_dict(overrides)
  return c


def losses(history):
  return {h["step"]: h["loss"] for h in history if "loss" in h}


def kept(workdir) -> dict:
  """What a workdir must never lose: its checkpoints, run config and metrics (caches may be rebuilt)."""
  out = {f"checkpoints/{k}": v for k, v in snapshot(os.path.join(workdir, "checkpoints")).items()}
  for name in ("config.json", METRICS_FILE):
    out[name] = open(os.path.join(workdir, name), "rb").read()
  return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """Losses of an uninterrupted run, and a workdir "killed" after step 6 (checkpoints 1, 2, 4, 6)."""
  workdir = str(tmp_path_factory.mktemp("reference"))
  trainer = Trainer(tiny_config(), workdir)
  expected = losses(trainer.run())
  trainer.close()
  crashed = str(tmp_path_factory.mktemp("crashed"))
  trainer = Trainer(tiny_config(), crashed)
  trainer.run(num_steps=6)
  trainer.close()
  assert sorted(int(s) for s in os.listdir(os.path.join(crashed, "checkpoints")) if s.isdigit()) == [1, 2, 4, 6]
  return expected, crashed


@pytest.fixture
def crashed(reference, tmp_path):
  return shutil.copytree(reference[1], tmp_path / "work")


def state_files(workdir, step):
  root = os.path.join(workdir, "checkpoints", str(step), "state")
  return sorted((os.path.join(r, f) for r, _, fs in os.walk(root) for f in fs if "/d/" in os.path.join(r, f)),
                key=os.path.getsize)


def test_truncated_newest_checkpoint_falls_back_and_resumes_with_the_same_losses(reference, crashed, caplog):
  expected, _ = reference
  victim = state_files(crashed, 6)[-1]  # the biggest array data file of the newest checkpoint
  size = os.path.getsize(victim)
  with open(victim, "r+b") as f:
    f.truncate(size // 2)
  damaged = snapshot(os.path.join(crashed, "checkpoints", "6"))
  with caplog.at_level("WARNING"):
    trainer = Trainer(tiny_config(), str(crashed))
  assert trainer.step == 4
  text = " ".join(r.getMessage() for r in caplog.records)
  assert "checkpoint step 6" in text and "unreadable" in text and "resuming from step 4" in text
  aside = os.listdir(os.path.join(crashed, "checkpoints.corrupt"))
  assert len(aside) == 1 and aside[0].startswith("6-")
  assert snapshot(os.path.join(crashed, "checkpoints.corrupt", aside[0])) == damaged  # kept as it was
  got = losses(trainer.run())
  trainer.close()
  assert sorted(got) == [5, 6, 7, 8]
  for step, loss in got.items():
    np.testing.assert_allclose(loss, expected[step], rtol=1e-6, err_msg=f"step {step}")


def _empty_data_metadata(workdir):
  open(os.path.join(workdir, "checkpoints", "6", "data", "metadata"), "w").close()


def _no_state_metadata(workdir):
  os.remove(os.path.join(workdir, "checkpoints", "6", "state", "_METADATA"))


def _empty_array_file(workdir):
  for path in state_files(workdir, 6):
    open(path, "w").close()


@pytest.mark.parametrize("damage", [_empty_data_metadata, _no_state_metadata, _empty_array_file])
def test_other_damage_to_the_newest_checkpoint_falls_back(crashed, damage):
  damage(crashed)
  trainer = Trainer(tiny_config(), str(crashed))
  try:
    assert trainer.step == 4
    assert sorted(trainer.checkpointer.all_steps()) == [1, 2, 4]
    assert [p.split("-")[0] for p in os.listdir(os.path.join(crashed, "checkpoints.corrupt"))] == ["6"]
  finally:
    trainer.close()


def test_all_checkpoints_unreadable_is_an_error_that_moves_nothing(crashed):
  for step in (1, 2, 4, 6):
    open(os.path.join(crashed, "checkpoints", str(step), "data", "metadata"), "w").close()
  before = kept(crashed)
  with pytest.raises(CorruptCheckpoints, match=r"no checkpoint in .* can be read: step 6: .*step 4: .*step 2: .*step 1: "):
    Trainer(tiny_config(), str(crashed))
  assert kept(crashed) == before


def test_resume_with_another_lora_rank_names_the_field_and_overwrites_nothing(crashed):
  before = kept(crashed)
  with pytest.raises(ValueError, match=r"newest step 6.*lora.rank: checkpoint 8, config 16; "
                                       r"lora.alpha: checkpoint 16.0, config 32.0"):
    Trainer(tiny_config(**{"lora.rank": 16, "lora.alpha": 32.0}), str(crashed))
  assert kept(crashed) == before  # config.json and the checkpoints untouched
  config_lib.check_resume(str(crashed), tiny_config(**{"optim.lr": 1e-4, "total_steps": 20}), 6)  # these may change


def test_shape_mismatch_without_a_saved_config_names_the_parameters(crashed):
  os.remove(os.path.join(crashed, "config.json"))  # e.g. a workdir from before config.json was kept
  with pytest.raises(CheckpointMismatch, match=r"checkpoint step 6 .*params/layers/k_lora_a: checkpoint \(2, 64, 8\), "
                                               r"config \(2, 64, 4\)"):
    Trainer(tiny_config(**{"lora.rank": 4}), str(crashed))
  assert sorted(int(s) for s in os.listdir(os.path.join(crashed, "checkpoints")) if s.isdigit()) == [1, 2, 4, 6]


def test_non_finite_training_stops_before_saving_or_exporting(tmp_path):
  with pytest.raises(ValueError, match="optim.lr=inf.*finite"):
    config_lib.validate(tiny_config(**{"optim.lr": float("inf")}))
  workdir = str(tmp_path)
  trainer = Trainer(tiny_config(**{"optim.lr": 1e30, "optim.warmup_steps": 0, "checkpoint.every": 1,
                                   "export": True}), workdir)
  with pytest.raises(NonFiniteError, match=r"training diverged: step 2 had a non-finite loss or gradient norm "
                                           r"\(loss=nan.*optim.lr=1e\+30. Stopped at step 2 without saving a "
                                           r"checkpoint or export of this state; the newest checkpoint is step 1"):
    trainer.run()
  trainer.close()
  assert trainer.checkpointer.all_steps() == [1]  # step 1's update was still finite (if huge)
  target = abstract_state(trainer.models, trainer.spec.optim, trainer.mesh, trainer.rules)
  restored, _ = trainer.checkpointer.restore(1, target)
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(restored.params))
  assert not os.path.exists(os.path.join(workdir, "adapter"))
  lines = [json.loads(line) for line in open(os.path.join(workdir, METRICS_FILE))]
  assert all(np.isfinite(line["loss"]) for line in lines if "loss" in line)


def test_sigterm_exits_143_after_its_checkpoint_and_metrics_survive(tmp_path):
  """The CLI: metrics.jsonl grows at every log step; SIGTERM saves the step it finished and exits 143."""
  workdir = tmp_path / "run"
  args = [sys.executable, "-m", "d2f_jax.distill", f"--config={ROOT}/configs/tiny.py:runlocal",
          f"--workdir={workdir}", "--config.total_steps=1000", "--config.log_every=1", "--config.eval_every=1000",
          "--config.checkpoint.every=500", "--config.data.synthetic_examples=96", "--config.data.eval_examples=8",
          "--config.eval_batches=1", "--config.progress_bar=False", "--config.export=False"]
  proc = subprocess.Popen(args, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  metrics = workdir / METRICS_FILE

  def ready():
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
      if metrics.exists() and sum(1 for line in open(metrics) if '"loss"' in line) >= 3:
        break
      time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
  err = sigterm_when_ready(proc, ready, timeout=120)
  assert proc.returncode == 143, err[-3000:]
  steps = [json.loads(line)["step"] for line in open(metrics)]
  last = max(steps)
  assert steps == list(range(0, last + 1)) and last >= 3  # every logged step, in order, flushed as it happened
  saved = sorted(int(s) for s in os.listdir(workdir / "checkpoints") if s.isdigit())
  assert saved[-1] == last, (saved, last)  # (step 1 is always saved: orbax saves a first checkpoint)
  assert "status 143" in err


def test_bad_config_is_one_line_exit_2(tmp_path):
  res = subprocess.run([sys.executable, "-m", "d2f_jax.distill", f"--config={ROOT}/configs/tiny.py:runlocal",
                        f"--workdir={tmp_path}", "--config.optim.lr=-1.0"], cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
                       timeout=120)
  assert res.returncode == 2, res.stderr[-2000:]
  lines = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
  assert lines == ["error: config.optim.lr=-1.0: must be a finite positive number"], res.stderr[-2000:]
  assert "Traceback" not in res.stderr
