"""Fuzzing checkpoint restore: seeded random damage to the newest checkpoint of a stopped training never
resumes from wrong bytes silently. Each mutation is either refused (the warning names the damaged step's
directory, the step is moved to `checkpoints.corrupt/`, and the previous step is restored bit-identically)
or provably harmless (the newest step restored bit-identical to what was saved, same data position).

Mutated, in step 4 of a run stopped after step 4 (checkpoints 1, 2, 4): bytes of any file (array data,
orbax metadata, the data position, the digest), truncations, deletions, and the data position replaced by
other valid JSON.
"""

import json
import logging
import os
import shutil

import numpy as np

from d2f_jax.train.checkpoint import Checkpointer
from test_checkpoint_integrity import _leaves, saved  # noqa: F401  (the module fixture)

CASES = 48
OTHER_POSITIONS = ['{"next_index": 5}', '{"next_index": 3}', '{}', '[]', '4', 'null', '{"next_index": "4"}',
                   '{"next_index": 4, "epoch": 1}', '{"next_index": 4.0}', '{"next_index": -1}']


def _files(step_dir) -> list[str]:
  return sorted(os.path.relpath(os.path.join(r, f), step_dir) for r, _, fs in os.walk(step_dir) for f in fs)


def _mutate(step_dir, rng) -> str:
  files = _files(step_dir)
  kind = ["flip", "flip", "flip", "truncate", "delete", "position"][rng.integers(6)]
  if kind == "position":
    text = OTHER_POSITIONS[rng.integers(len(OTHER_POSITIONS))]
    open(os.path.join(step_dir, "data", "metadata"), "w").write(text)
    return f"position {text}"
  name = files[rng.integers(len(files))]
  path = os.path.join(step_dir, name)
  if kind == "delete":
    os.remove(path)
    return f"delete {name}"
  blob = bytearray(open(path, "rb").read())
  if kind == "truncate":
    open(path, "wb").write(bytes(blob[:rng.integers(len(blob))]))
    return f"truncate {name}"
  if blob:
    at, width = int(rng.integers(len(blob))), int(rng.integers(1, 65))
    for i in range(at, min(at + width, len(blob))):
      blob[i] ^= int(rng.integers(1, 256))
  open(path, "wb").write(bytes(blob))
  return f"flip {name}"


def test_mutations_are_refused_with_a_fallback_or_restore_identical_state(saved, tmp_path, caplog):  # noqa: F811
  workdir, target, template, reference = saved
  source = os.path.join(workdir, "checkpoints")
  rng = np.random.default_rng(20261205)
  outcomes = {}
  for case in range(CASES):
    directory = str(tmp_path / f"case{case}" / "checkpoints")
    shutil.copytree(source, directory)
    what = _mutate(os.path.join(directory, "4"), rng)
    caplog.clear()
    checkpointer = Checkpointer(directory, every=2, keep=4)
    with caplog.at_level(logging.WARNING):
      step, state, data = checkpointer.restore_newest(target, data_template=template)
    checkpointer.close()
    if step == 4:
      assert _leaves(state) == reference[4] and data == {"next_index": 4}, what
      outcome = "harmless"
    else:
      assert step == 2, (what, step, caplog.text)
      assert _leaves(state) == reference[2] and data == {"next_index": 2}, what
      assert os.path.join(directory, "4") in caplog.text and "resuming from step 2" in caplog.text, (what, caplog.text)
      assert [p.split("-")[0] for p in os.listdir(directory + ".corrupt")] == ["4"], what
      outcome = "refused"
    key = (what.split()[0], outcome)
    outcomes[key] = outcomes.get(key, 0) + 1
    shutil.rmtree(tmp_path / f"case{case}")
  print(json.dumps({f"{k[0]} {k[1]}": v for k, v in sorted(outcomes.items())}))
  # The fuzzer reaches both outcomes: it really damages, and really leaves harmless bytes.
  assert outcomes.get(("flip", "refused"), 0) >= 5 and outcomes.get(("position", "refused"), 0) >= 3, outcomes
