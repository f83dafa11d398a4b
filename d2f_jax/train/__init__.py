"""One Trainer, three objectives (`config.objective`):

- distill: D2F asymmetric distillation (section 3), a block-causal student learns from a bidirectional teacher;
- mdm: LLaDA's masked-diffusion loss, pre-training / SFT of the bidirectional base (the teacher);
- ar: causal next-token prediction, the same-size autoregressive baseline.

    from d2f_jax.train import Trainer
    Trainer(config, workdir).run()

Modules: config (defaults, validation), objectives (the table the step dispatches on), loss (distill),
loss_mdm, loss_ar, chunks (row-chunked logits), schedule + masking (distill noise), model (teacher /
student trees), sharding (mesh, logical rules), optim, state, step (jitted steps), data (grain),
checkpoint (orbax), metrics (MFU, TensorBoard), trainer (the loop), synthetic (tiny offline setup).
"""


def __getattr__(name):
  # Lazy: `import d2f_jax.train.schedule` should not pull in orbax, grain and transformers.
  if name == "Trainer":
    from d2f_jax.train.trainer import Trainer
    return Trainer
  raise AttributeError(f"module 'd2f_jax.train' has no attribute {name!r}")
