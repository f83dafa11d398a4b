r"""D2F distillation of Dream-v0-Base-7B: LoRA r32 / alpha 32 / dropout 0.1 on q, k, v, o_proj; block 16;
AdamW (0.9, 0.95), wd 0.05, clip 1.0, constant LR 5e-6; 1024-token rows; Dream's logit shift is applied to
teacher and student alike (it is part of the model config).

  python -m d2f_jax.distill --config configs/dream_7b.py:gpu_8xh100 --workdir /runs/d2f_dream \
      --config.model.path=/ckpt/Dream-v0-Base-7B --config.data.path=/data/qa.jsonl
  arg: a hardware preset (gpu_8xa100, gpu_8xh100, gpu_2x8xh100, tpu_v5p_64, tpu_v5e_64, cpu) and/or
       runlocal (tiny Dream with synthetic data and these hyper-parameters, a few steps on any machine).
Dream has 4 KV heads: with tensor > 4 the KV projections stay replicated on the extra ways.
"""

from d2f_jax.train.recipes import d2f_lora_recipe


def get_config(arg=None):
  return d2f_lora_recipe(arg, family="dream", lr=5e-6)
