r"""D2F distillation of LLaDA2.0 / 2.1-flash (mixture of experts, 103B total, 6.1B active): the llada2_mini.py
recipe (LoRA on the attention, router and experts frozen, block 32, LR 1e-5, 1024-token rows) on a pod.

  python -m d2f_jax.distill --config configs/llada2_flash.py:tpu_v5p_64 --workdir /mnt/shared/runs/d2f_flash \
      --config.model.path=/ckpt/LLaDA2.0-flash --config.data.path=/data/qa.jsonl
  arg: a hardware preset (default tpu_v5p_64: data 4 x fsdp 8, 64 rows a step; gpu_2x8xh100, tpu_v5e_64, ...)
       and/or runlocal (tiny LLaDA2 with synthetic data, a few steps on any machine).
The student exports merged into the base (PEFT cannot name LLaDA2's fused q / k / v), which needs the whole
base (~206 GB) on one host: a multi-host run ends without the export and says so; rerun the command on one
host with ':cpu' and JAX_PLATFORMS=cpu (it resumes at the final step and exports to <workdir>/hf).
The same step at block 16 (configs/llada_8b.py:tpu_v5p_64 with the llada2-flash preset) compiled and fit v5p-64,
39.37 GiB of 85.5 usable a chip (docs/models.md); check this one with
`python -m d2f_jax.aot --target v5p-64 --config configs/llada2_flash.py --program train`.
"""

from d2f_jax.train.recipes import d2f_lora_recipe


def get_config(arg=None):
  return d2f_lora_recipe(arg, family="llada2", lr=1e-5, block_size=32, hw="tpu_v5p_64")
