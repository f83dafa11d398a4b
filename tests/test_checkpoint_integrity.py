"""Checkpoints that were damaged on disk, or cannot be written: a digest of every saved array and of the data
position catches damage orbax cannot see (the step is moved aside and the previous one resumed), a data
position of the wrong form is damage too, and a full disk is one error naming the path and errno."""

import asyncio
import errno
import logging
import os
import shutil
import threading

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from d2f_jax.train.state import abstract_state
from d2f_jax.train.trainer import Trainer
from test_robust_train import state_files, tiny_config

STEPS = 4  # checkpoints 1, 2, 4 (every 2, orbax always saves the first)


@pytest.fixture(scope="session")  # shared with test_fuzz_checkpoint.py
def saved(tmp_path_factory):
  """A workdir stopped after step 4, the abstract state to restore into, and each step's state as saved."""
  workdir = str(tmp_path_factory.mktemp("saved"))
  trainer = Trainer(tiny_config(), workdir)
  trainer.run(num_steps=STEPS)
  trainer.close()
  target = abstract_state(trainer.models, trainer.spec.optim, trainer.mesh, trainer.rules)
  reference = {step: _leaves(trainer.checkpointer.restore(step, target)[0]) for step in (2, 4)}
  return workdir, target, trainer.data.get_state(), reference


@pytest.fixture
def crashed(saved, tmp_path):
  return shutil.copytree(saved[0], tmp_path / "work")


def _leaves(state) -> list[bytes]:
  return [np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x).tobytes()
          for x in jax.tree.leaves(state.to_dict())]


def _resumed_step(workdir, caplog) -> tuple[int, str]:
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    trainer = Trainer(tiny_config(), str(workdir))
  trainer.close()
  return trainer.step, caplog.text


def test_flipped_bytes_in_an_array_file_are_caught(crashed, caplog):
  """Which array the middle of the biggest data file holds depends on the order orbax's writers finished in:
  flipped bytes in a zstd-compressed chunk fail to decode (orbax sees it), in a chunk stored raw they decode to
  other values (only the digest sees it). Either way the step is moved aside, naming why."""
  victim = state_files(crashed, 4)[-1]  # the biggest array file of the newest step, as in the issue
  blob = bytearray(open(victim, "rb").read())
  middle = len(blob) // 2
  blob[middle:middle + 64] = bytes(b ^ 0xFF for b in blob[middle:middle + 64])
  open(victim, "wb").write(bytes(blob))
  step, text = _resumed_step(crashed, caplog)
  assert step == 2, text
  assert ("does not match its sha256 digest" in text or "is unreadable" in text) and "resuming from step 2" in text
  assert [p.split("-")[0] for p in os.listdir(crashed / "checkpoints.corrupt")] == ["4"]


def test_valid_arrays_that_are_not_the_saved_ones_are_caught_by_the_digest(crashed, caplog):
  """Damage orbax cannot see: step 2's arrays under step 4 decode cleanly; only the digest saved with step 4
  refuses them."""
  state = crashed / "checkpoints" / "4" / "state"
  shutil.rmtree(state)
  shutil.copytree(crashed / "checkpoints" / "2" / "state", state)
  step, text = _resumed_step(crashed, caplog)
  assert step == 2, text
  assert "does not match its sha256 digest" in text and "resuming from step 2" in text
  assert [p.split("-")[0] for p in os.listdir(crashed / "checkpoints.corrupt")] == ["4"]


def test_a_data_position_replaced_by_other_valid_json_falls_back_naming_the_file(crashed, caplog):
  (crashed / "checkpoints" / "4" / "data" / "metadata").write_text('{"position": 3}')
  step, text = _resumed_step(crashed, caplog)
  assert step == 2, text
  assert os.path.join(str(crashed), "checkpoints", "4", "data", "metadata") in text and "resuming from step 2" in text


def _disk_full(monkeypatch):
  async def full(self, x, directory):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory / "metadata"))
  monkeypatch.setattr(ocp.JsonCheckpointHandler, "_save_fn", full)


def _disk_full_while_a_sibling_still_writes(monkeypatch, seconds=3.0):
  """The data item fails at once while the digest item is still writing (as the arrays' writes may be when
  orbax reports the first failure): it creates its directory seconds later, after the error surfaced."""
  written = threading.Event()

  async def uneven(self, x, directory):
    if "digest" not in str(directory):
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory / "metadata"))
    await asyncio.sleep(seconds)
    os.makedirs(directory, exist_ok=True)
    (directory / "metadata").write_text("{}")
    written.set()
  monkeypatch.setattr(ocp.JsonCheckpointHandler, "_save_fn", uneven)
  return written


@pytest.mark.parametrize("failure", [_disk_full, _disk_full_while_a_sibling_still_writes])
def test_a_full_disk_during_a_save_is_one_error_naming_path_and_errno(failure, tmp_path, monkeypatch, capsys):
  """The CLI (in process): one `error:` line with the path and ENOSPC, exit 2, no partial checkpoint left,
  also when another item of the save is still writing as the failure surfaces (a CI run caught that race)."""
  from types import SimpleNamespace
  from d2f_jax import distill
  workdir = tmp_path / "run"
  sibling_written = failure(monkeypatch)
  monkeypatch.setattr(distill, "_CONFIG", SimpleNamespace(value=tiny_config(total_steps=2)))
  monkeypatch.setattr(distill, "_WORKDIR", SimpleNamespace(value=str(workdir)))
  with pytest.raises(SystemExit) as exit_info:
    distill.main(["distill"])
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  lines = [line for line in err.splitlines() if line.startswith("error: ")]
  assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
  assert f"{workdir}/checkpoints" in lines[0] and "[Errno 28 ENOSPC] No space left on device" in lines[0], lines
  assert "1.orbax-checkpoint-tmp" in lines[0], lines  # the path that could not be written
  if sibling_written is not None:  # look once the late writer is done: it must not have brought the directory back
    assert sibling_written.wait(timeout=60)
  assert not [p for p in os.listdir(workdir / "checkpoints") if "orbax-checkpoint-tmp" in p]
  assert not os.path.exists(workdir / ".d2f_jax.lock")


def test_a_checkpoint_in_the_old_attention_layout_resumes_reshaped(saved, tmp_path, caplog):
  """A training checkpoint written before heads were packed with head_dim (q / k / v LoRA b [L, r, heads, D],
  o's a [L, H, D, r], and their Adam moments) resumes: its arrays reshaped, every byte as in today's layout."""
  from d2f_jax.train.checkpoint import Checkpointer
  from d2f_jax.train.state import TrainState
  workdir, target, data_state, reference = saved
  work = shutil.copytree(workdir, tmp_path / "work")
  shutil.rmtree(work / "checkpoints")
  from d2f_jax.models import preset
  config = tiny_config()
  heads, head_dim = preset(config.model.preset).num_heads, preset(config.model.preset).head_dim
  state = Checkpointer(os.path.join(workdir, "checkpoints"), every=2, keep=4).restore(4, target)[0]
  old_shapes = []

  def unpack(path, x):
    name = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
    if name.endswith(("q_lora_b", "k_lora_b", "v_lora_b")):
      x = x.reshape(*x.shape[:2], -1, head_dim)
    elif name.endswith("o_lora_a"):
      x = x.reshape(x.shape[0], heads, head_dim, x.shape[-1])
    else:
      return x
    old_shapes.append(x.shape)
    return x
  old = jax.tree_util.tree_map_with_path(unpack, state.to_dict())
  assert len(old_shapes) >= 4 * 3, old_shapes  # the four adapted projections, with both Adam moments
  writer = Checkpointer(str(work / "checkpoints"), every=1, keep=4, async_save=False)
  writer.save(4, TrainState.from_dict(old), data_state, force=True)
  writer.wait()
  writer.close()
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    trainer = Trainer(config, str(work))
  assert trainer.step == 4, caplog.text
  assert "written before attention heads were packed with head_dim" in caplog.text
  assert _leaves(trainer.state) == reference[4]
  trainer.close()
