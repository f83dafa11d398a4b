"""The learning-rate schedules: the reference's constant rate is the default; cosine / linear decay reach 0
exactly at total_steps; bad settings fail at validation naming the field."""

import math

import pytest

from d2f_jax.train import config as config_lib
from d2f_jax.train.optim import OptimSpec, learning_rate


def rates(spec, steps):
  schedule = learning_rate(spec)
  return [float(schedule(s)) for s in steps]


def test_default_is_the_reference_constant_rate_after_warmup():
  spec = OptimSpec.from_config(config_lib.base_config().optim, total_steps=100)
  assert spec.decay == "constant"
  assert rates(OptimSpec(lr=1e-3, warmup_steps=10), [0, 5, 10, 99, 10_000]) == pytest.approx(
      [0.0, 5e-4, 1e-3, 1e-3, 1e-3])


@pytest.mark.parametrize("decay,middle", [("cosine", 0.5), ("linear", 0.5)])
def test_decay_warms_up_then_reaches_zero_at_total_steps(decay, middle):
  spec = OptimSpec(lr=2.0, warmup_steps=10, decay=decay, decay_steps=110)
  got = rates(spec, [0, 5, 10, 60, 110, 200])
  assert got == pytest.approx([0.0, 1.0, 2.0, 2.0 * middle, 0.0, 0.0], abs=1e-6)
  if decay == "cosine":  # a quarter of the way: (1 + cos(pi / 4)) / 2 of the peak
    assert rates(spec, [35])[0] == pytest.approx(1.0 + math.cos(math.pi / 4), rel=1e-5)


def test_from_config_takes_the_runs_total_steps():
  c = config_lib.base_config()
  c.optim.decay = "cosine"
  assert OptimSpec.from_config(c.optim, total_steps=123).decay_steps == 123


def test_bad_decay_settings_name_the_field():
  c = config_lib.base_config()
  c.model.path, c.data.path = "/ckpt/base", "/data/qa.jsonl"  # only the optimizer's fields are wrong
  config_lib.validate(c)
  c.optim.decay = "exponential"
  with pytest.raises(ValueError, match="optim.decay.*exponential"):
    config_lib.validate(c)
  c.optim.decay, c.optim.warmup_steps, c.total_steps = "cosine", 50, 50
  with pytest.raises(ValueError, match="optim.decay.*total_steps"):
    config_lib.validate(c)
  with pytest.raises(ValueError, match="optim.decay='nope'"):
    learning_rate(OptimSpec(decay="nope"))
