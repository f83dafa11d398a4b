"""The notebooks: in sync with notebooks/build.py, committed without outputs, a Colab badge and a guarded install
first, and each runs top to bottom on the tiny models (nbclient, the python3 kernel of this environment)."""

import os
import sys

import nbformat
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = os.path.join(ROOT, "notebooks")
NAMES = ("quickstart", "distill_tiny", "pipeline_visualisation")
CELL_TIMEOUT_S = 180

sys.path.insert(0, NOTEBOOKS)
import build  # noqa: E402


def _read(name):
  return nbformat.read(os.path.join(NOTEBOOKS, f"{name}.ipynb"), as_version=4)


def test_notebooks_are_what_build_py_writes():
  assert set(build.NOTEBOOKS) == set(NAMES)
  assert build.main(["--check"]) == 0, "run: python notebooks/build.py"


@pytest.mark.parametrize("name", NAMES)
def test_committed_clean_with_badge_and_guarded_install(name):
  nb = _read(name)
  nbformat.validate(nb)
  for cell in nb.cells:
    if cell.cell_type == "code":
      assert cell.outputs == [] and cell.execution_count is None, "commit notebooks with outputs cleared"
  badge = f"https://colab.research.google.com/github/d2f-jax/d2f_jax/blob/main/notebooks/{name}.ipynb"
  assert nb.cells[0].cell_type == "markdown" and badge in nb.cells[0].source
  install = nb.cells[1].source
  assert nb.cells[1].cell_type == "code" and "except ImportError" in install
  # Off a checkout: pip install with the extra of the runtime's backend, so pip keeps the matching jax.
  assert 'install -q "d2f_jax[{_extra}] @ git+https://github.com/d2f-jax/d2f_jax"' in install
  assert '{"tpu": "tpu,eval", "gpu": "cuda12,eval"}.get(jax.default_backend(), "eval")' in install


@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs_top_to_bottom(name, monkeypatch, tmp_path):
  from nbclient import NotebookClient
  # The kernel inherits this environment: CPU only, the checkout importable, temporary files in tmp_path.
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
  monkeypatch.setenv("TMPDIR", str(tmp_path))
  monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend draws the figures
  nb = _read(name)
  client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                          resources={"metadata": {"path": NOTEBOOKS}})
  client.execute()  # raises CellExecutionError, naming the cell (a runaway: past CELL_TIMEOUT_S), when one fails
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
  assert not errors
  images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
  assert images, "every notebook draws at least one figure"
