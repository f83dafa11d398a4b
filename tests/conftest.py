"""Suite-wide JAX settings: CPU, fast compiles, fp32 matmuls at full precision."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# Benchmark files: this workplace keeps them beside the checkout (the library's default is ~/.local/share/d2f_jax).
_SHARED_DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.pardir, "shared", "data")
if os.path.isdir(_SHARED_DATA):
  os.environ.setdefault("D2F_DATA_DIR", os.path.abspath(_SHARED_DATA))  # nothing here may reach the Hub; test_hub.py builds its own cache

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
# Tiny models: optimisation passes cost more compile time than they save at run time.
jax.config.update("jax_disable_most_optimizations", True)
