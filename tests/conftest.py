"""Suite-wide JAX settings (CPU, fast compiles, fp32 matmuls at full precision) and the benchmark data rule.

Benchmark data: every test sees an empty data directory ($D2F_DATA_DIR points at one), so a test that
needs a benchmark file it did not name fails on every machine, not only on a user's clone. Tests of the
loaders, runner, sandbox and adapters use the project's own small files (`fixture_data_dir`,
tests/fixtures/benchmark_data.py). The few tests whose point is the real files carry
`@pytest.mark.real_data("<file>")`: they run against the user's data directory ($D2F_DATA_DIR, else
~/.local/share/d2f_jax, as the library resolves it before this file empties it) and skip, saying which
file and how to provide it, when it is absent.
"""

import os
import pathlib
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach the Hub; test_hub.py builds its own cache
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import jax  # noqa: E402
import pytest  # noqa: E402

from d2f_jax import datafiles, xla_maps  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
# Tiny models: optimisation passes cost more compile time than they save at run time.
jax.config.update("jax_disable_most_optimizations", True)

# Where the user keeps the real files, by the library's own rule, read before this file empties
# $D2F_DATA_DIR; xdist workers inherit the emptied variable, so the first reading travels beside it.
_USER_DATA_DIR_ENV = "D2F_TESTS_USER_DATA_DIR"
USER_DATA_DIR = pathlib.Path(os.environ.get(_USER_DATA_DIR_ENV) or datafiles.data_dir())
os.environ[_USER_DATA_DIR_ENV] = str(USER_DATA_DIR)
FIXTURE_DATA_DIR = pathlib.Path(__file__).resolve().parent / "fixtures" / "data"
REAL_FILES = {  # what a real_data test may name, and where the file comes from
    "gsm8k_test.jsonl": "the GSM8K test split (openai/grade-school-math, grade_school_math/data/test.jsonl)",
    "HumanEval.jsonl.gz": "HumanEval (openai/human-eval, data/HumanEval.jsonl.gz)",
}
_EMPTY_DATA_DIR = tempfile.mkdtemp(prefix="d2f_jax_tests_no_data_")
os.environ[datafiles.DATA_DIR_ENV] = _EMPTY_DATA_DIR  # also inherited by the subprocesses tests start


def pytest_configure(config):
  config.addinivalue_line("markers", "real_data(*files): needs these real benchmark files from the user's data "
                                     "directory ($D2F_DATA_DIR); skipped with the reason when one is absent")


def pytest_unconfigure(config):
  shutil.rmtree(_EMPTY_DATA_DIR, ignore_errors=True)


def pytest_runtest_setup(item):
  for mark in item.iter_markers("real_data"):
    if not mark.args or any(name not in REAL_FILES for name in mark.args):
      raise pytest.UsageError(f"{item.nodeid}: real_data names one or more of {sorted(REAL_FILES)}, got {mark.args}")
    for name in mark.args:
      if not (USER_DATA_DIR / name).is_file():
        pytest.skip(f"needs the real {name} ({REAL_FILES[name]}): not found in {USER_DATA_DIR}; "
                    f"put it there or set ${datafiles.DATA_DIR_ENV} to the directory holding it")


@pytest.fixture(autouse=True)
def _real_data_directory(request, monkeypatch):
  """A real_data test reads the user's data directory, through the library's default path like a user."""
  if request.node.get_closest_marker("real_data") is not None:
    monkeypatch.setenv(datafiles.DATA_DIR_ENV, str(USER_DATA_DIR))


@pytest.fixture(scope="session")
def fixture_data_dir() -> pathlib.Path:
  """The project's own small GSM8K / HumanEval files (tests/fixtures/benchmark_data.py writes them)."""
  return FIXTURE_DATA_DIR


@pytest.fixture
def product_compile_settings():
  """Compile as the product does: this file's suite-wide settings (most optimisations off, fp32 matmuls at
  'highest') change fusion decisions and the compilers' memory plans. Restored afterwards."""
  saved = {name: jax.config.values[name] for name in ("jax_disable_most_optimizations",
                                                        "jax_default_matmul_precision")}
  jax.config.update("jax_disable_most_optimizations", False)
  jax.config.update("jax_default_matmul_precision", None)
  yield
  for name, value in saved.items():
    jax.config.update(name, value)


@pytest.fixture(autouse=True)
def _mapping_headroom():
  """After each test, free JAX's compiled programs once this worker holds half the memory mappings Linux
  allows: XLA:CPU maps every compiled kernel on its own and a worker that reaches the cap crashes in its next
  compile (d2f_jax/xla_maps.py, tests/test_xla_maps.py). Every test then starts far from it."""
  yield
  limit = xla_maps.mapping_limit()
  if limit:
    xla_maps.ensure_headroom(reserve=limit // 2, force=True)
