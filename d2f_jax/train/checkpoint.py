"""Orbax checkpoints of the train state and the data position; saving on preemption; corrupt ones set aside.

Each checkpoint holds `state` (step, trainable params, optimizer state, RNG; restored straight into its
shardings) and `data` (the grain iterator position, JSON). Saves are async: orbax copies the arrays to
host before `save` returns, so the donated state can be overwritten by the next step while files are
written. A SIGTERM (single process) or JAX's preemption sync point (multi-host, where the distributed
runtime turns the notice into an agreed step) makes the loop save and stop at a step boundary.

`restore_newest` tries the newest checkpoint first; one that cannot be read (a truncated file, an empty
`data/metadata`, a missing `state/_METADATA`), whose arrays or data position do not match the digests saved
with them (`digest`, see digest.py), or whose data position is not one the run's iterator can take, is
reported and the next older one is tried. Unreadable newer
ones are then moved to `<checkpoints>.corrupt/` (never deleted), so the run continues from the newest intact
step and later saves cannot collide with them. Shapes that do not fit the run's config are a different
error (`CheckpointMismatch`, naming each parameter): that is the config's fault, not the files'.

A save that cannot be written (disk full, permissions: any OSError, also from the async writer) raises
CheckpointWriteError naming the path and errno, after removing the partial `*.orbax-checkpoint-tmp*`
directories; the older checkpoints are intact and a rerun resumes from them.
"""

from __future__ import annotations

import logging
import errno
import glob
import os
import shutil
import signal
import threading
import time

import jax
import orbax.checkpoint as ocp

from d2f_jax.train.layout_migration import pack, packing_only, shapes_of, unpacked_target
from d2f_jax.train import digest as digest_lib
from d2f_jax.train.state import TrainState

log = logging.getLogger(__name__)


class CheckpointMismatch(ValueError):
  """A checkpoint whose arrays do not fit the run's config (e.g. a changed lora.rank)."""


class CorruptCheckpoints(RuntimeError):
  """No checkpoint of a workdir can be read."""


class CheckpointWriteError(RuntimeError):
  """A checkpoint could not be written (an OSError such as ENOSPC); the message names the path and errno."""


def _os_error(error: BaseException) -> OSError | None:
  """The OSError behind `error` (orbax wraps the async writer's in its own), or None."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, OSError) and error.errno is not None:
      return error
    for inner in getattr(error, "exceptions", ()):  # an ExceptionGroup
      found = _os_error(inner)
      if found is not None:
        return found
    error = error.__cause__ or error.__context__
  return None


def _short(error: BaseException, limit: int = 300) -> str:
  text = " ".join(str(error).split()) or type(error).__name__
  return text if len(text) <= limit else text[:limit - 3] + "..."


class Checkpointer:
  def __init__(self, directory: str, *, every: int, keep: int, async_save: bool = True):
    self.directory = os.path.abspath(directory) if "://" not in directory else directory
    self._options = ocp.CheckpointManagerOptions(save_interval_steps=every, max_to_keep=keep,
                                                 enable_async_checkpointing=async_save, create=True)
    self.manager = self._open()

  def _open(self) -> ocp.CheckpointManager:
    # Handlers named up front (not only through the save / restore args), so a fresh manager can read the
    # arrays' metadata before anything is restored.
    handlers = {"state": ocp.StandardCheckpointHandler(), "data": ocp.JsonCheckpointHandler(),
                "digest": ocp.JsonCheckpointHandler()}
    return ocp.CheckpointManager(self.directory, options=self._options, item_handlers=handlers)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def due(self, step: int) -> bool:
    """Whether `save(step, ...)` would write a checkpoint without `force`."""
    return self.manager.should_save(step)

  @property
  def corrupt_directory(self) -> str:
    return self.directory.rstrip("/") + ".corrupt"

  def _saved_shapes(self, step: int) -> dict[str, tuple[int, ...]]:
    """The shapes checkpoint `step` holds, from its metadata; empty when that is unreadable (corruption,
    judged by the restore that follows, not a mismatch)."""
    try:
      return shapes_of(self.manager.item_metadata(step)["state"])
    except Exception:  # noqa: BLE001 - orbax / tensorstore / JSON errors of damaged files
      return {}

  def check_shapes(self, step: int, abstract: TrainState) -> None:
    """Refuse checkpoint `step` if its arrays' shapes differ from `abstract`'s, naming each such array."""
    saved = self._saved_shapes(step)
    if not saved:
      return
    wanted = shapes_of(abstract.to_dict())
    if packing_only(saved, wanted):
      return  # written before heads were packed with head_dim: `restore` reshapes it
    diffs = [f"{k}: checkpoint {saved.get(k, 'absent')}, config {wanted.get(k, 'absent')}"
             for k in sorted(set(saved) | set(wanted), key=lambda k: (not k.startswith("params/"), k))
             if saved.get(k) != wanted.get(k)]  # the parameters first: the optimizer's moments follow them
    if diffs:
      more = f" (and {len(diffs) - 6} more)" if len(diffs) > 6 else ""
      raise CheckpointMismatch(f"checkpoint step {step} in {self.directory} does not fit this config: "
                               + "; ".join(diffs[:6]) + more)

  def restore_newest(self, abstract: TrainState, data_template: dict | None = None
                     ) -> tuple[int, TrainState, dict] | None:
    """(step, state, data position) of the newest readable checkpoint, or None when there is none.

    data_template: a fresh data iterator's position; a saved one of another form counts as damage.
    Unreadable newer checkpoints are logged and moved aside; if none can be read, CorruptCheckpoints is
    raised and nothing is moved (then the cause is likely not the files)."""
    failures: list[tuple[int, BaseException]] = []
    for step in sorted(self.manager.all_steps(), reverse=True):
      self.check_shapes(step, abstract)
      try:
        state, data = self.restore(step, abstract)
        digest_lib.check_data_position(data, data_template, os.path.join(self.directory, str(step)))
      except Exception as e:  # noqa: BLE001 - orbax / tensorstore / JSON errors of damaged files
        log.warning("checkpoint step %d (%s) is unreadable (%s); trying the next older one", step,
                    os.path.join(self.directory, str(step)), _short(e))
        failures.append((step, e))
        continue
      if failures:
        self._set_aside([s for s, _ in failures], step)
      return step, state, data
    if failures:
      raise CorruptCheckpoints(f"no checkpoint in {self.directory} can be read: " +
                               "; ".join(f"step {s}: {_short(e, 200)}" for s, e in failures))
    return None

  def _set_aside(self, steps: list[int], kept: int) -> None:
    """Move unreadable checkpoints out of the manager's directory (kept for inspection, never deleted)."""
    if jax.process_index() == 0:
      os.makedirs(self.corrupt_directory, exist_ok=True)
      for step in steps:
        target = os.path.join(self.corrupt_directory, f"{step}-{time.strftime('%Y%m%d-%H%M%S')}")
        shutil.move(os.path.join(self.directory, str(step)), target)
        log.warning("checkpoint step %d is corrupt: moved to %s; resuming from step %d", step, target, kept)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      multihost_utils.sync_global_devices("d2f_jax corrupt checkpoints moved")
    self.manager.close()
    self.manager = self._open()

  def save(self, step: int, state: TrainState, data_state: dict, *, force: bool = False) -> bool:
    """Save if `step` is due (or `force`), with the digests of its arrays and data position; returns whether
    a save started. CheckpointWriteError when this save or the previous async one could not be written."""
    if not force and not self.manager.should_save(step):
      return False
    tree = state.to_dict()
    args = ocp.args.Composite(state=ocp.args.StandardSave(tree), data=ocp.args.JsonSave(data_state),
                              digest=ocp.args.JsonSave(digest_lib.make(tree, data_state)))
    return self._writing(step, lambda: self.manager.save(step, args=args, force=force))

  def _writing(self, step: int | None, write):
    """Run `write`; an OSError in it (or surfacing from an earlier async save) becomes one CheckpointWriteError
    naming the path and errno, after the partial temporary directories are removed."""
    try:
      return write()
    except Exception as e:  # noqa: BLE001 - only OSErrors are turned into a write error
      cause = _os_error(e)
      if cause is None:
        raise
      removed = self._remove_partial()
      code = errno.errorcode.get(cause.errno, str(cause.errno))
      where = cause.filename or self.directory  # an async save's error surfaces at the next save or wait
      steps = [s for s in self.all_steps() if os.path.isdir(os.path.join(self.directory, str(s)))]
      raise CheckpointWriteError(
          f"cannot write a checkpoint in {self.directory}: {where}: [Errno {cause.errno} {code}] "
          f"{cause.strerror or cause}; removed the partial {', '.join(map(os.path.basename, removed)) or 'nothing'}; "
          f"the checkpoints already written ({', '.join(map(str, steps)) or 'none'}) are intact: free the space and "
          "rerun to resume") from e

  def _remove_partial(self) -> list[str]:
    """Remove the partial directories once nothing writes into them any more: orbax's async writer waits on
    its item writes in order and reports the first failure while later ones (the arrays) may still be
    creating files, which would bring a removed directory back."""
    self._finish_pending_writes()
    if jax.process_index() != 0:
      return []
    pattern = os.path.join(glob.escape(self.directory), "*.orbax-checkpoint-tmp*")
    partial = sorted(glob.glob(pattern))
    for path in partial:
      shutil.rmtree(path, ignore_errors=True)
    left = glob.glob(pattern)
    if left:
      raise CheckpointWriteError(f"cannot remove the partial checkpoint directories {', '.join(left)} in "
                                 f"{self.directory}: remove them by hand before rerunning")
    return partial

  def _finish_pending_writes(self, timeout_s: float = 300.0) -> None:
    """Wait for the last async save's item writes that are still running after one of them failed (their
    own errors are the same failure, already being reported). The futures are orbax's private state: when a
    version of orbax keeps them elsewhere there is nothing to wait on and the check in _remove_partial
    still refuses to leave a partial directory behind silently."""
    async_manager = getattr(getattr(self.manager, "_checkpointer", None), "_async_manager", None)
    deadline = time.monotonic() + timeout_s
    for pending in list(getattr(async_manager, "_commit_futures", None) or ()):
      try:
        pending.result(timeout=max(0.0, deadline - time.monotonic()))
      except Exception:  # noqa: BLE001 - a sibling's failure; the first one is the error reported
        pass

  def restore(self, step: int, abstract: TrainState) -> tuple[TrainState, dict]:
    """(state laid out like `abstract`'s shardings, data position) of checkpoint `step`, checked against the
    digests saved with it (DigestMismatch); a checkpoint from before digests were kept is restored unchecked."""
    where = os.path.join(self.directory, str(step))
    target, unpacked = self._target(step, abstract.to_dict())
    items = dict(state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore())
    checked = os.path.isdir(os.path.join(where, "digest"))
    if checked:
      items["digest"] = ocp.args.JsonRestore()
    restored = self.manager.restore(step, args=ocp.args.Composite(**items))
    if checked:
      digest_lib.verify(restored["digest"], restored["state"], restored["data"], where)
    else:
      log.warning("checkpoint step %d in %s has no digest (written before digests were kept): restored unchecked",
                  step, self.directory)
    state = restored["state"]
    if unpacked:
      log.warning("checkpoint step %d in %s was written before attention heads were packed with head_dim; "
                  "%d arrays reshaped on restore (the next save writes today's layout)", step, self.directory,
                  len(unpacked))
      state = pack(state, abstract.to_dict(), unpacked)
    return TrainState.from_dict(state), restored["data"]

  def _target(self, step: int, wanted: dict) -> tuple[dict, set[str]]:
    """(what to restore checkpoint `step` into, the paths it holds in the old attention layout)."""
    return unpacked_target(self._saved_shapes(step), wanted)

  def reached_preemption(self, step: int) -> bool:
    return self.manager.reached_preemption(step)

  def wait(self) -> None:
    self._writing(None, self.manager.wait_until_finished)

  def close(self) -> None:
    self.manager.close()


class StopSignal:
  """Turns SIGTERM into a flag the train loop polls (then it saves and returns instead of dying).

  Installed only in the main thread of a single-process run; multi-host runs rely on JAX's preemption
  sync point instead, so every host stops after the same step.
  """

  def __init__(self):
    self.requested = False
    self._previous = None
    if threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._handle)

  def _handle(self, signum, frame):
    log.warning("SIGTERM: saving a checkpoint after the current step, then stopping")
    self.requested = True

  def restore(self) -> None:
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
      self._previous = None
