r"""D2F distillation of LLaDA-8B-Instruct: LoRA r32 / alpha 32 / dropout 0.1 on q, k, v, attn_out; block 16;
AdamW (0.9, 0.95), wd 0.05, clip 1.0, constant LR 1e-5; 1024-token rows.

  python -m d2f_jax.distill --config configs/llada_8b.py:tpu_v5p_64 --workdir /mnt/shared/runs/d2f_llada \
      --config.model.path=/ckpt/LLaDA-8B-Instruct --config.data.path=/data/qa.jsonl
  arg: a hardware preset (gpu_8xa100, gpu_8xh100, gpu_2x8xh100, tpu_v5p_64, tpu_v5e_64, cpu) and/or
       runlocal (tiny LLaDA with synthetic data and these hyper-parameters, a few steps on any machine).
A converted directory (python -m d2f_jax.convert) loads faster than the HF one on pods: it is restored
shard by shard straight onto the mesh.
"""

from d2f_jax.train.recipes import d2f_lora_recipe


def get_config(arg=None):
  return d2f_lora_recipe(arg, family="llada", lr=1e-5)
