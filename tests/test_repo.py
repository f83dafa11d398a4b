"""The README's commands and CI stay in sync: CI runs exactly the README's test command."""

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
  text = (ROOT / "README.md").read_text()
  block = text.split("```bash", 1)[1].split("```", 1)[0]
  return [line for line in block.splitlines() if line and not line.startswith("#")]


def test_readme_starts_with_main_job_and_test_commands():
  main, tests = _readme_commands()[:2]
  assert main.endswith("python -m d2f_jax.main")
  assert "pip install -r requirements.txt" in main and "pip install -r requirements.txt" in tests
  assert tests.split("&& ")[-1].startswith("python -m pytest")


def test_ci_runs_the_readme_test_command():
  test_command = _readme_commands()[1].split("&& ")[-1]
  ci = (ROOT / ".ci" / "run").read_text().splitlines()
  assert test_command in ci, f"{test_command!r} is not a line of .ci/run"
  assert any("pip install -q -r requirements.txt" in line for line in ci)


def test_ci_runs_the_compile_tier_with_the_compilers_required():
  """After the suite, both real compilers run tests/accel, and a missing compiler fails instead of skipping."""
  ci = (ROOT / ".ci" / "run").read_text().splitlines()
  suite = ci.index(_readme_commands()[1].split("&& ")[-1])
  tier = [line for line in ci[suite + 1:] if "tests/accel" in line]
  assert [line.split(" -m ")[-1].split()[0] for line in tier] == ["tpu", "cuda"], tier
  assert all(line.startswith("D2F_ACCEL_REQUIRED=1 ") for line in tier)
  assert any(line.startswith(".ci/accel_venvs.sh") for line in ci[suite + 1:])
