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


def test_real_data_tests_skip_with_the_reason_on_a_clone_without_the_files(tmp_path):
  """A user's clone has no benchmark files: the tests that need them skip, naming the file, never fail.
  (Every other test already runs against an empty data directory: tests/conftest.py.)"""
  import os
  import re
  import subprocess
  import sys

  decorator = re.compile(r"^@pytest\.mark\.real_data\(", re.M)
  counts = {str(p): len(decorator.findall(p.read_text())) for p in (ROOT / "tests").glob("test_*.py")}
  files = sorted(f for f, n in counts.items() if n)
  marked = sum(counts.values())
  assert marked >= 3, files
  empty = tmp_path / "no_data"
  empty.mkdir()
  env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "D2F_DATA_DIR", "D2F_TESTS_"))}
  env.update(D2F_DATA_DIR=str(empty), JAX_PLATFORMS="cpu")
  run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-m", "real_data",
                        *files], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  out = run.stdout + run.stderr
  assert run.returncode == 0, out[-4000:]
  summary = out.strip().splitlines()[-1]
  assert re.fullmatch(rf"{marked} skipped, \d+ deselected in [\d.]+s( \(.*\))?", summary), out[-4000:]
  for name in ("gsm8k_test.jsonl", "HumanEval.jsonl.gz"):
    assert f"needs the real {name}" in out and f"not found in {empty}" in out, out[-4000:]


def test_ci_points_the_suite_at_the_real_benchmark_files():
  ci = (ROOT / ".ci" / "run").read_text().splitlines()
  suite = ci.index(_readme_commands()[1].split("&& ")[-1])
  assert any("export D2F_DATA_DIR=" in line for line in ci[:suite])


def test_the_readme_is_short_and_every_link_resolves():
  """README.md is what a newcomer finishes (under ~250 lines); reference material lives in docs/, every page
  linked from the README, and no relative link in either points at nothing."""
  import re
  readme = (ROOT / "README.md").read_text()
  assert len(readme.splitlines()) <= 250
  pages = sorted((ROOT / "docs").glob("*.md"))
  assert pages and all(f"](docs/{p.name})" in readme for p in pages), [p.name for p in pages]
  for path in [ROOT / "README.md", *pages]:
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
      if not re.match(r"[a-z]+://", target):
        assert (path.parent / target).exists(), f"{path.relative_to(ROOT)} links to {target}, which does not exist"
