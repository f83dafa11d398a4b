"""The authors' D2F distillation recipe, shared by configs/llada_8b.py, dream_7b.py and llada2_{mini,flash}.py:
LoRA r32 / alpha 32 / dropout 0.1 on q, k, v, o; block 16 (32 for LLaDA2, its native block); 1024-token rows;
AdamW (0.9, 0.95), wd 0.05, clip 1.0 (base_config), constant LR per model; a `runlocal` variant on the
family's tiny preset."""

from __future__ import annotations

import ml_collections

from d2f_jax.train.config import apply_hardware, base_config, parse_arg


def d2f_lora_recipe(arg, *, family: str, lr: float, block_size: int = 16,
                    hw: str = "gpu_8xa100") -> ml_collections.ConfigDict:
  """arg: 'HW' (an apply_hardware preset, default `hw`) and/or 'runlocal' (tiny, CPU, 4 steps)."""
  arg = parse_arg(arg, positional="hw", hw=hw, runlocal=False)
  c = base_config()
  c.model.dtype = "bfloat16"
  c.finetune = "lora"
  c.lora.update(dict(rank=32, alpha=32.0, dropout=0.1, targets=("q", "k", "v", "o")))
  c.block_size = block_size
  c.remat = True  # recompute layers in the backward pass: the AOT check needs it to fit 1024-token rows
  c.data.seq_len = 1024
  c.loss_chunk = 256  # 126k / 152k-vocab logits in 256-row chunks
  c.optim.lr = lr
  c.total_steps = 10_000
  c.checkpoint.update(dict(every=500, keep=3))
  apply_hardware(c, arg.hw)
  if arg.runlocal:
    c.model.preset, c.model.synthetic, c.model.dtype = f"tiny-{family}", True, "float32"
    c.data.seq_len, c.loss_chunk, c.data.eval_examples = 128, 32, 16
    c.total_steps, c.log_every, c.eval_every = 4, 1, 4
    c.checkpoint.every = 2
    apply_hardware(c, "cpu")
  return c
