"""Asymmetric distillation (D2F section 3): a block-causal student learns from a bidirectional teacher.

    from d2f_jax.train import Trainer
    Trainer(config, workdir).run()

Modules: config (defaults, validation), schedule + masking (noise), loss, model (teacher / student trees),
sharding (mesh, logical rules), optim, state, step (jitted steps), data (grain), checkpoint (orbax),
metrics (MFU, TensorBoard), trainer (the loop), synthetic (tiny offline setup).
"""


def __getattr__(name):
  # Lazy: `import d2f_jax.train.schedule` should not pull in orbax, grain and transformers.
  if name == "Trainer":
    from d2f_jax.train.trainer import Trainer
    return Trainer
  raise AttributeError(f"module 'd2f_jax.train' has no attribute {name!r}")
