r"""D2F distillation of LLaDA2.0 / 2.1-mini (mixture of experts, 16B total, 1.4B active): LoRA r32 / alpha 32 /
dropout 0.1 on the attention's q, k, v, o (split from the fused query_key_value), router and experts frozen;
block 32, the block LLaDA2 was trained and decodes with (its prompt attends in blocks from position 0);
AdamW (0.9, 0.95), wd 0.05, clip 1.0, constant LR 1e-5; 1024-token rows.

  python -m d2f_jax.distill --config configs/llada2_mini.py:gpu_8xh100 --workdir /runs/d2f_llada2_mini \
      --config.model.path=/ckpt/LLaDA2.0-mini --config.data.path=/data/qa.jsonl
  arg: a hardware preset (default gpu_8xh100; gpu_8xa100, gpu_2x8xh100, tpu_v5p_64, tpu_v5e_64, cpu) and/or
       runlocal (tiny LLaDA2 with synthetic data and these hyper-parameters, a few steps on any machine).
`python -m d2f_jax.aot --config configs/llada2_mini.py --target TARGET --program train` compiles this step for
llada2-mini (the file name picks the preset when no model.path is given).
"""

from d2f_jax.train.recipes import d2f_lora_recipe


def get_config(arg=None):
  return d2f_lora_recipe(arg, family="llada2", lr=1e-5, block_size=32, hw="gpu_8xh100")
