"""The main job reuses a finished stage only when it ran with the requested config: `--config.student.steps=6`
on a workdir whose student stage finished with 4 steps reused the 4-step model and wrote steps = 6 into
results.json. Now it is refused naming the fields, and `--config.rerun=student` trains the stage again."""

import json
import os

import pytest

from d2f_jax.e2e import pipeline
from test_e2e import _config


class FakeTrainer:
  """Stands in for the Trainer: 'trains' by writing the export directory, and counts runs."""
  runs = []

  preempted = False  # a class default; the preempted test sets it on one instance
  step = 0

  def __init__(self, config, workdir):
    self.config, self.workdir = config, workdir

  def run(self):
    FakeTrainer.runs.append(self.config.total_steps)
    os.makedirs(os.path.join(self.workdir, "hf"), exist_ok=True)
    with open(os.path.join(self.workdir, "hf", "config.json"), "w") as f:
      json.dump({"steps": self.config.total_steps}, f)
    return [{"step": self.config.total_steps, "loss": 1.0}]

  def close(self):
    pass


def _student(c, workdir):
  kw = dict([s for s in pipeline.stages(c) if s[0] == "student"][0][2])
  kw.pop("init")
  return pipeline.stage_config(c, data_path="d.npz", tokenizer_dir="tok", model_path=str(workdir / "teacher" / "hf"),
                               **kw)


@pytest.fixture
def finished(tmp_path, monkeypatch):
  monkeypatch.setattr(pipeline, "Trainer", FakeTrainer)
  monkeypatch.setattr(pipeline, "mark_attention", lambda *a: None)
  FakeTrainer.runs = []
  c = _config("smoke")
  pipeline.train_stage("student", _student(c, tmp_path), str(tmp_path))
  return c, tmp_path


def test_a_finished_stage_is_reused_with_the_same_config_and_refused_with_another(finished):
  c, workdir = finished
  _, summary = pipeline.train_stage("student", _student(c, workdir), str(workdir))
  assert summary["skipped"] and "config" not in summary and FakeTrainer.runs == [4]
  c.student.steps = 6
  with pytest.raises(ValueError, match=r"stage student .*finished with another config .*total_steps: finished 4, "
                                       r"requested 6.*--config.rerun=student"):
    pipeline.train_stage("student", _student(c, workdir), str(workdir))
  assert FakeTrainer.runs == [4]


def test_rerun_moves_the_finished_stage_aside_and_trains_it_again(finished):
  c, workdir = finished
  c.student.steps = 6
  _, summary = pipeline.train_stage("student", _student(c, workdir), str(workdir), rerun=True)
  assert summary["steps"] == 6 and FakeTrainer.runs == [4, 6]
  [old] = [p for p in os.listdir(workdir) if p.startswith("student.old-")]
  assert json.load(open(workdir / old / "hf" / "config.json")) == {"steps": 4}  # kept, never deleted
  pipeline.train_stage("student", _student(c, workdir), str(workdir))  # now finished with 6: reused
  assert FakeTrainer.runs == [4, 6]


def test_a_marker_from_before_configs_were_recorded_is_compared_by_its_steps(finished):
  c, workdir = finished
  marker = workdir / "student" / "stage_done.json"
  done = json.loads(marker.read_text())
  marker.write_text(json.dumps({k: v for k, v in done.items() if k != "config"}))
  pipeline.train_stage("student", _student(c, workdir), str(workdir))  # 4 steps, as recorded
  c.student.steps = 6
  with pytest.raises(ValueError, match=r"total_steps: finished 4, requested 6"):
    pipeline.train_stage("student", _student(c, workdir), str(workdir))


def test_a_changed_upstream_stage_changes_the_downstream_identity():
  c = _config("smoke")
  config = pipeline.stage_config(c, objective="distill", data_path="d", tokenizer_dir="t", steps=4, lr=1e-3, warmup=1)
  a = pipeline.stage_identity(config, {"total_steps": 4}, {"seed": 0})
  b = pipeline.stage_identity(config, {"total_steps": 5}, {"seed": 0})
  assert a != b and a["init.total_steps"] == 4 and "model.path" not in a


def test_a_preempted_stage_says_so_and_is_not_marked_finished(tmp_path, monkeypatch):
  """A stage the Trainer stopped on SIGTERM / a preemption notice (checkpoint saved, no export) is reported as
  stopped at its step, resumable, not as a stage that 'finished without writing its export'; no done marker."""
  class Preempted(FakeTrainer):
    def run(self):
      self.preempted, self.step = True, 3
      return [{"step": 3, "loss": 1.0}]

  class LastStep(FakeTrainer):  # a notice at the final step: the trainer saved and exported, the stage is done
    def run(self):
      self.preempted, self.step = True, self.config.total_steps
      return super().run()

  monkeypatch.setattr(pipeline, "Trainer", Preempted)
  monkeypatch.setattr(pipeline, "mark_attention", lambda *a: None)
  c = _config("smoke")
  with pytest.raises(pipeline.StagePreempted, match=r"stage student stopped .* at step 3 of 4 .* resumes it"):
    pipeline.train_stage("student", _student(c, tmp_path), str(tmp_path))
  assert not os.path.exists(tmp_path / "student" / "stage_done.json")
  monkeypatch.setattr(pipeline, "Trainer", LastStep)
  pipeline.train_stage("student", _student(c, tmp_path), str(tmp_path))
  assert os.path.exists(tmp_path / "student" / "stage_done.json")


def test_fields_added_later_are_left_out_at_their_defaults():
  """A teacher stage finished before mdm.semi_ar existed trained as its default does: still reused. The long
  variant's teacher (semi_ar > 0, ar_weight 1) records them; its window is the decode block (32, the default:
  left out)."""
  for arg, semi_ar, ar_weight, window in (("smoke", None, None, 32), ("long,smoke", 0.5, 1.0, 32)):
    c = _config(arg)
    kw = dict([s for s in pipeline.stages(c) if s[0] == "teacher"][0][2])
    kw.pop("init")
    config = pipeline.stage_config(c, data_path="d", tokenizer_dir="t", **kw)
    identity = pipeline.stage_identity(config)
    assert identity.get("mdm.semi_ar") == semi_ar and "mdm.window" not in identity and config.mdm.window == window
    assert "mdm.suffix_weight" not in identity and config.mdm.suffix_weight == 1.0
    assert identity.get("mdm.ar_weight") == ar_weight and config.mdm.ar_weight == (ar_weight or 0.0)
    assert identity["mdm.eps"] == 1e-3
    # added later still: an MoE base's expert dispatch
    assert "model.expert_dispatch" not in identity and config.model.expert_dispatch is None
    # and length buckets: the default run's batches are whole (left out), the long variant's are cut (recorded)
    buckets = [160, 192, 224, 256] if arg.startswith("long") else None
    assert identity.get("data.length_buckets") == buckets and tuple(config.data.length_buckets) == tuple(buckets or ())
  c = _config("long,smoke")
  c.decode_block_size = 16
  kw = dict([s for s in pipeline.stages(c) if s[0] == "teacher"][0][2])
  kw.pop("init")
  assert pipeline.stage_identity(pipeline.stage_config(c, data_path="d", tokenizer_dir="t", **kw))["mdm.window"] == 16
  c.teacher.ar_weight = 0.25  # a teacher with the AR loss mixed in records it, so it is not reused as another
  kw = dict([s for s in pipeline.stages(c) if s[0] == "teacher"][0][2])
  kw.pop("init")
  config = pipeline.stage_config(c, data_path="d", tokenizer_dir="t", **kw)
  assert config.mdm.ar_weight == 0.25 and pipeline.stage_identity(config)["mdm.ar_weight"] == 0.25
