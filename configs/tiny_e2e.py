r"""The miniature D2F reproduction that `python -m d2f_jax.main` runs by default (about 14 min on 2 CPU cores).

A LLaDA-layout teacher is pre-trained from scratch with the masked-diffusion objective on the built-in
arithmetic task, a same-size causal model is trained as the AR baseline, the D2F student is distilled
from the teacher with the real trainer, and all decoders are compared on held-out problems.

  python -m d2f_jax.main                                   # this config, workdir ./workdir/tiny_e2e
  python -m d2f_jax.main --config configs/tiny_e2e.py:smoke --workdir /tmp/e2e   # a minute, for tests
"""

import ml_collections

from d2f_jax.train.config import parse_arg


def get_config(arg=None):
  arg = parse_arg(arg, smoke=False)
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.task = ml_collections.ConfigDict(dict(train=6000, test=128, min_steps=1, max_steps=2))
  c.seq_len = 80
  c.model = ml_collections.ConfigDict(dict(embed_dim=128, num_layers=4, num_heads=4, num_kv_heads=4, head_dim=32,
                                           mlp_dim=384, rope_theta=10_000.0, norm_eps=1e-5))
  c.batch_size = 32
  # Stage lengths in optimizer steps; learning rates are toy-scale (from scratch, tiny model).
  c.teacher = ml_collections.ConfigDict(dict(steps=1800, lr=2e-3, warmup=60))
  c.ar = ml_collections.ConfigDict(dict(steps=300, lr=2e-3, warmup=30))
  c.student = ml_collections.ConfigDict(dict(steps=300, lr=1e-3, warmup=20, finetune="full", lora_rank=32))
  c.block_size = 8
  c.max_new_tokens = 40  # longest solution (39 tokens + EOS) in whole blocks
  # D2F threshold sweep: (tau_add, tau_act, tau_conf); the first is the paper's default.
  c.d2f_sweep = [(0.1, 0.95, 0.9), (0.3, 0.9, 0.8), (0.5, 0.9, 0.7)]
  c.threshold_tau_conf = 0.9
  c.max_blocks_in_flight = 4
  c.eval_batch_size = 1  # the paper's setting
  if arg.smoke:
    c.task.update(dict(train=256, test=4))
    c.teacher.steps, c.ar.steps, c.student.steps = 6, 4, 4
    c.batch_size = 8
    c.d2f_sweep = [(0.1, 0.95, 0.9), (0.5, 0.9, 0.7)]
  return c
