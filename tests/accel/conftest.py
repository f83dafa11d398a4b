"""The compile tier: the real TPU (libtpu / Mosaic) and NVIDIA (CUDA plugin / Triton -> PTX) compilers, run
ahead of time on a host without the hardware. Each test is marked with the compiler it needs (`tpu`, `cuda`);
.ci/run runs `-m tpu` in the TPU venv and `-m cuda` in the CUDA venv (made by .ci/accel_venvs.sh):

  D2F_ACCEL_REQUIRED=1 /work/venvs/tpu/bin/python -m pytest -q tests/accel -m tpu -p no:cacheprovider
  D2F_ACCEL_REQUIRED=1 /work/venvs/cuda/bin/python -m pytest -q tests/accel -m cuda -p no:cacheprovider

A test whose compiler is missing is skipped (so the CPU suite, which also collects this directory, only
reports skips), except under D2F_ACCEL_REQUIRED=1, where it fails: the tier cannot pass by skipping.
"""

import os

import pytest
from accel_evidence import has_compiler

# libtpu takes a host-wide lock (/tmp/libtpu_lockfile) that would refuse a second process (a CLI child, another
# job on the machine); nothing here touches a TPU, so several compile-only users are fine.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

REQUIRED_ENV = "D2F_ACCEL_REQUIRED"
COMPILERS = {"tpu": "the TPU compiler (libtpu; venv from .ci/accel_venvs.sh: <root>/tpu)",
             "cuda": "the NVIDIA compiler (jax-cuda12-plugin; venv from .ci/accel_venvs.sh: <root>/cuda)"}


def required() -> bool:
  return os.environ.get(REQUIRED_ENV, "") not in ("", "0")


def pytest_configure(config):
  config.addinivalue_line("markers", "tpu: needs the TPU compiler (libtpu)")
  config.addinivalue_line("markers", "cuda: needs the NVIDIA compiler (jax-cuda12-plugin + ptxas)")


def pytest_runtest_setup(item):
  here = os.path.dirname(os.path.abspath(__file__))
  if not str(item.path).startswith(here + os.sep):
    return
  needs = [name for name in COMPILERS if item.get_closest_marker(name)]
  if not needs:  # a defect in the test, whatever the environment
    pytest.fail("a test in tests/accel needs a tpu or cuda marker (the compiler it runs)", pytrace=False)
  missing = [name for name in needs if not has_compiler(name)]
  if missing:
    reason = f"needs {', '.join(COMPILERS[m] for m in missing)}, missing in this environment"
    if required():
      pytest.fail(f"{REQUIRED_ENV}=1: {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(autouse=True)
def _product_compile_settings(product_compile_settings):
  """Every compile-tier test compiles as the product does (tests/conftest.py's fixture; the CPU suite, which
  loads this file too, gets its own settings back afterwards)."""
  yield
