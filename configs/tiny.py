"""Tiny training runs on a laptop CPU in about a minute, fully offline.

A random tiny LLaDA / Dream checkpoint (real HF format, with tokenizer) and a synthetic question/answer
JSONL are written into the workdir, then distilled with the reference recipe at toy scale (or trained with
the mdm / ar objective: a full fine-tune of that checkpoint, or with `random` of fresh weights).

  python -m d2f_jax.distill --config configs/tiny.py --workdir /tmp/tiny
  python -m d2f_jax.distill --config configs/tiny.py:family=dream,full --workdir /tmp/tiny_dream
  python -m d2f_jax.distill --config configs/tiny.py:objective=mdm,random --workdir /tmp/tiny_mdm
  arg: family=llada|dream|llada2, objective=distill|mdm|ar, full (full fine-tune instead of LoRA; implied by
       mdm / ar), random (fresh weights instead of the synthetic checkpoint; mdm / ar), runlocal (a few steps)
"""

from d2f_jax.train.config import base_config, parse_arg


def get_config(arg=None):
  arg = parse_arg(arg, family="llada", objective="distill", full=False, random=False, runlocal=False)
  if arg.family not in ("llada", "dream", "llada2"):
    raise ValueError(f"tiny.py: family must be llada, dream or llada2, got {arg.family!r}")
  c = base_config()
  c.objective = arg.objective
  c.model.init = "random" if arg.random else "path"
  c.model.preset = f"tiny-{arg.family}"
  c.model.synthetic = True  # with `random`: only the data and the tokenizer are used
  c.model.dtype = "float32"
  full = arg.full or arg.objective != "distill"
  c.finetune = "full" if full else "lora"
  c.lora.update(dict(rank=8, alpha=16.0, dropout=0.0))

  c.data.seq_len = 64
  c.data.synthetic_examples = 544
  c.data.eval_examples = 32
  c.block_size = 8
  c.batch_size = 8
  c.total_steps = 10 if arg.runlocal else 60
  c.optim.lr = 1e-3 if full else 3e-3  # toy scale: large steps so a minute of training shows
  c.optim.warmup_steps = 5

  c.mesh.update(dict(data=1, fsdp=-1, tensor=1))
  c.checkpoint.update(dict(every=20, keep=2))
  c.log_every = 5
  c.eval_every = 20
  c.eval_batches = 4
  return c
