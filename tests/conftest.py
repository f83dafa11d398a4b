"""Suite-wide JAX settings: CPU, fast compiles, fp32 matmuls at full precision."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # nothing here may reach the Hub; test_hub.py builds its own cache

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
# Tiny models: optimisation passes cost more compile time than they save at run time.
jax.config.update("jax_disable_most_optimizations", True)
