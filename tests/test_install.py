"""A plain (non-editable) install works away from the checkout: `pip install --no-deps .` into a throwaway
target directory, then `python -m d2f_jax.main --config configs/tiny_e2e.py:smoke` from another working
directory resolves the packaged config and runs (about a minute and a half on 2 cores; the install itself
takes ~2 s). The package list in pyproject.toml is checked against the source tree, so a new subpackage
cannot silently go missing from the wheel."""

import os
import pathlib
import shutil
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_subpackage_and_the_configs_are_packaged():
  tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
  found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "d2f_jax").rglob("__init__.py")}
  assert set(tool["packages"]) == found | {"d2f_jax.configs"}, set(tool["packages"]) ^ (found | {"d2f_jax.configs"})
  assert tool["package-dir"] == {"d2f_jax.configs": "configs"}
  deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  assert not any(d.startswith("jax[") for d in deps["dependencies"])  # plain jax: the extras pick the backend
  assert set(deps["optional-dependencies"]) >= {"cpu", "tpu", "cuda12", "eval", "test"}


def test_config_paths_resolve_to_the_packaged_files(tmp_path, monkeypatch):
  from d2f_jax import config_files
  monkeypatch.chdir(tmp_path)  # no configs/ here
  resolved = config_files.resolve("configs/tiny_e2e.py:smoke")
  assert resolved.endswith(os.path.join("configs", "tiny_e2e.py") + ":smoke") and os.path.isfile(resolved[:-6])
  assert config_files.resolve("configs/nope.py") == "configs/nope.py"  # left for the loader's own error
  own = tmp_path / "configs" / "tiny_e2e.py"  # a user's file of the same name wins
  own.parent.mkdir()
  own.write_text("def get_config(arg=None):\n  return None\n")
  assert config_files.resolve("configs/tiny_e2e.py") == "configs/tiny_e2e.py"


_SHOW_CONFIG = """
import sys
from d2f_jax import config_files, usage
CONFIG = config_files.DEFINE_config_file("config", sys.argv.pop(1), "")
usage.run_absl(lambda argv: print(CONFIG.value.ar.steps, CONFIG.value.student.steps, CONFIG.value.task.test), "doc")
"""


@pytest.mark.parametrize("default", ["configs/tiny_e2e.py", "configs/tiny_e2e.py:smoke"])
@pytest.mark.parametrize("given", [False, True])
def test_field_overrides_apply_with_the_default_config_and_a_given_one(tmp_path, default, given):
  """`--config.ar.steps=7` reaches the config whether --config is given or left at its (resolved) default."""
  argv = ["--config", default] if given else []
  out = subprocess.run([sys.executable, "-c", _SHOW_CONFIG, default, *argv, "--config.ar.steps=7",
                        "--config.student.steps=5"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.split() == ["7", "5", "4" if default.endswith(":smoke") else "256"], out.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
  """The package installed non-editably into a target directory, from a copy of the sources."""
  base = tmp_path_factory.mktemp("install")
  src = base / "src"
  for name in ("d2f_jax", "configs"):
    shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
  for name in ("pyproject.toml", "README.md"):
    shutil.copy(ROOT / name, src / name)
  site = base / "site"
  subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                  "--target", str(site), str(src)], check=True, capture_output=True, text=True, timeout=300)
  return site


def _env(site):
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}
  return dict(env, PYTHONPATH=str(site), JAX_PLATFORMS="cpu")


def test_installed_package_is_the_one_imported_and_carries_its_data(installed, tmp_path):
  code = ("import d2f_jax, d2f_jax.configs, importlib.resources as r; print(d2f_jax.__file__); "
          "print(r.files('d2f_jax.aot').joinpath('targets', 'h100.txtpb').is_file())")
  out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_env(installed), capture_output=True,
                       text=True, timeout=120, check=True).stdout.split()
  assert out[0].startswith(str(installed)) and out[1] == "True", out


def test_main_smoke_runs_from_another_directory(installed, tmp_path):
  cwd = tmp_path / "elsewhere"
  cwd.mkdir()
  proc = subprocess.run([sys.executable, "-m", "d2f_jax.main", "--config", "configs/tiny_e2e.py:smoke",
                         "--workdir", str(tmp_path / "run")], cwd=cwd, env=_env(installed), capture_output=True,
                        text=True, timeout=900)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert (tmp_path / "run" / "results.json").is_file() and "results in" in proc.stdout
