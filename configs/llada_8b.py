r"""D2F distillation of LLaDA-8B-Instruct: LoRA r32 / alpha 32 / dropout 0.1 on q, k, v, attn_out; block 16;
AdamW (0.9, 0.95), wd 0.05, clip 1.0, constant LR 1e-5; 1024-token rows.

  python -m d2f_jax.distill --config configs/llada_8b.py:tpu_v5p_64 --workdir /mnt/shared/runs/d2f_llada \
      --config.model.path=/ckpt/LLaDA-8B-Instruct --config.data.path=/data/qa.jsonl
  arg: a hardware preset (gpu_8xa100, gpu_8xh100, gpu_2x8xh100, tpu_v5p_64, tpu_v5e_64, cpu) and/or
       runlocal (tiny LLaDA with synthetic data and these hyper-parameters, a few steps on any machine).
A converted directory (python -m d2f_jax.convert) loads faster than the HF one on pods: it is restored
shard by shard straight onto the mesh.
"""

from d2f_jax.train.config import apply_hardware, base_config, parse_arg


def get_config(arg=None):
  arg = parse_arg(arg, positional="hw", hw="gpu_8xa100", runlocal=False)
  c = base_config()
  c.model.dtype = "bfloat16"
  c.finetune = "lora"
  c.lora.update(dict(rank=32, alpha=32.0, dropout=0.1, targets=("q", "k", "v", "o")))
  c.block_size = 16
  c.remat = True  # recompute layers in the backward pass: the AOT check needs it to fit 1024-token rows
  c.data.seq_len = 1024
  c.loss_chunk = 256  # 126k-vocab logits in 256-row chunks
  c.optim.lr = 1e-5
  c.total_steps = 10_000
  c.checkpoint.update(dict(every=500, keep=3))
  apply_hardware(c, arg.hw)
  if arg.runlocal:
    c.model.preset, c.model.synthetic, c.model.dtype = "tiny-llada", True, "float32"
    c.data.seq_len, c.loss_chunk, c.data.eval_examples = 128, 32, 16
    c.total_steps, c.log_every, c.eval_every = 4, 1, 4
    c.checkpoint.every = 2
    apply_hardware(c, "cpu")
  return c
