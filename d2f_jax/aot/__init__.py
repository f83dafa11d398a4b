r"""The compile tier: compile the product's programs with the real TPU or NVIDIA compiler, without the hardware.

  python -m d2f_jax.aot --target v5p-64 --config configs/llada_8b.py:tpu_v5p_64 --program train
  python -m d2f_jax.aot --target 8xh100 --config configs/dream_7b.py:gpu_8xh100 --program train --json out.json
  python -m d2f_jax.aot --target v5e-8 --config configs/llada_8b.py --program d2f_decode --program ar_decode
  python -m d2f_jax.aot --target h100 --config configs/dream_7b.py --program d2f_decode --batch 1,32
  python -m d2f_jax.aot --target cpu-8 --config configs/llada_8b.py:tpu_v5p_64 --quick --mesh data=2,fsdp=2,tensor=2

Programs: `train` is the config's train step (its objective; teacher + LoRA student for distill) built by the
Trainer's own `train.step.spec_from_config` and `compiled_train_step`; `d2f_decode` / `ar_decode` are the whole
jitted decode loop `generate` runs (`decode.runner.decode_program`; default prompt 512, 256 new tokens,
block 32, batch 1 and 32). Inputs are abstract (`jax.ShapeDtypeStruct` + sharding): no weight is allocated.

Targets: TPU slices (v4 / v5e / v5p / v6e) compile with libtpu's compile-only topologies; `h100`, `8xh100`,
`a100`, ... with the CUDA plugin's deviceless compile (Triton to PTX/cubin; target descriptions in
d2f_jax/aot/targets). A real target never falls back to the CPU: without its compiler the check prints one
line naming the environment to use and exits 2. `cpu-N` (N fake CPU devices) checks the partitioning only.
Attention defaults to the Pallas kernels on a real target (inside shard_map under the mesh).

Per program it prints the compiler's per-device memory (arguments, outputs, aliased, temporaries, generated
code) against the device's HBM (90% usable) and the compile seconds. `--config.FIELD=VALUE` overrides a config
field, as for distill. Exit status: 0 every program compiled and fits; 1 a compile failed; 2 bad arguments or
the target's compiler is missing; 3 a program does not fit the device.
"""

from d2f_jax.aot.cli import main
from d2f_jax.aot.topology import GPU_ARCH, HBM_GIB, USABLE_FRACTION, CompilerMissing, Topology, parse_target

__all__ = ["main", "parse_target", "Topology", "CompilerMissing", "HBM_GIB", "USABLE_FRACTION", "GPU_ARCH"]
