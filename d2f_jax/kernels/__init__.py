"""Pallas attention kernels (Triton on GPU, Mosaic on TPU) for the id rule of `d2f_jax.models.attention`.

- `flash_attention`: full sequences, forward and backward (training, no-cache inference);
- `window_attention`: a decoding window against the static KV cache plus itself;
- `attend` / `attend_window`: what the model calls, dispatching on `ModelConfig.attention_impl`.
Each kernel has its pure-jnp reference beside it; `impl="auto"` falls back to it on CPU.
"""

from d2f_jax.kernels.attend import attend, attend_window, visible_length
from d2f_jax.kernels.block_sizes import BlockSizes
from d2f_jax.kernels.flash_attention import flash_attention, flash_attention_reference
from d2f_jax.kernels.window_attention import window_attention, window_attention_reference

__all__ = ["attend", "attend_window", "visible_length", "BlockSizes", "flash_attention",
           "flash_attention_reference", "window_attention", "window_attention_reference"]
