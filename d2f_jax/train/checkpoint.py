"""Orbax checkpoints of the train state and the data position; saving on preemption.

Each checkpoint holds `state` (step, trainable params, optimizer state, RNG; restored straight into its
shardings) and `data` (the grain iterator position, JSON). Saves are async: orbax copies the arrays to
host before `save` returns, so the donated state can be overwritten by the next step while files are
written. A SIGTERM (single process) or JAX's preemption sync point (multi-host, where the distributed
runtime turns the notice into an agreed step) makes the loop save and stop at a step boundary.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

import orbax.checkpoint as ocp

from d2f_jax.train.state import TrainState

log = logging.getLogger(__name__)


class Checkpointer:
  def __init__(self, directory: str, *, every: int, keep: int, async_save: bool = True):
    self.directory = os.path.abspath(directory) if "://" not in directory else directory
    options = ocp.CheckpointManagerOptions(save_interval_steps=every, max_to_keep=keep,
                                           enable_async_checkpointing=async_save, create=True)
    self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "data"))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state: TrainState, data_state: dict, *, force: bool = False) -> bool:
    """Save if `step` is due (or `force`); returns whether a save started."""
    args = ocp.args.Composite(state=ocp.args.StandardSave(state.to_dict()), data=ocp.args.JsonSave(data_state))
    return self.manager.save(step, args=args, force=force)

  def restore(self, step: int, abstract: TrainState) -> tuple[TrainState, dict]:
    """(state laid out like `abstract`'s shardings, data position) of checkpoint `step`."""
    restored = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract.to_dict()),
                                                                  data=ocp.args.JsonRestore()))
    return TrainState.from_dict(restored["state"]), restored["data"]

  def reached_preemption(self, step: int) -> bool:
    return self.manager.reached_preemption(step)

  def wait(self) -> None:
    self.manager.wait_until_finished()

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
