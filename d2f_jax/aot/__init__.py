"""The compile tier: the product's programs compiled with the real TPU or NVIDIA compiler, without the
hardware. Usage and exit statuses: `python -m d2f_jax.aot --help` (d2f_jax/aot/cli.py)."""

from d2f_jax.aot.cli import main
from d2f_jax.aot.topology import GPU_ARCH, HBM_GIB, USABLE_FRACTION, CompilerMissing, Topology, parse_target

__all__ = ["main", "parse_target", "Topology", "CompilerMissing", "HBM_GIB", "USABLE_FRACTION", "GPU_ARCH"]
