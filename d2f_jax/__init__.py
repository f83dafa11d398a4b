"""d2f_jax: discrete diffusion forcing (D2F) for LLaDA and Dream in JAX/Flax."""

__version__ = "0.1.0"


def __getattr__(name):
  # Lazy so `import d2f_jax.models` stays light and the loader's heavier imports come only when used.
  if name in ("load_model", "Model"):
    from d2f_jax import api
    return getattr(api, name)
  raise AttributeError(f"module 'd2f_jax' has no attribute {name!r}")
