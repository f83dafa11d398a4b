"""Named compile targets and their devices: TPU slices through libtpu's compile-only topologies, NVIDIA
GPUs through the CUDA plugin's deviceless compile, and fake CPU devices (only when `cpu-N` is asked for).

A real target never falls back to the CPU: without its compiler, `devices` raises `CompilerMissing`, whose
one-line message says how to install it (the CLI prints it and exits 2).
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import importlib.util
import math
import os
import re
import subprocess

GiB = 1 << 30

# Per-device memory (GiB, nominal) of each target kind.
HBM_GIB: dict[str, float] = {"v4": 32, "v5e": 16, "v5p": 95, "v6e": 32, "a100": 80, "h100": 80, "cpu": 16}
# What XLA leaves a program: the runtime, collectives' scratch and fragmentation take the rest.
USABLE_FRACTION = 0.9

# GPU kinds -> the target description (a GpuTargetConfig text proto shipped in d2f_jax/aot/targets).
GPU_TARGETS = {"h100": "h100.txtpb", "a100": "a100.txtpb"}
GPU_ARCH = {"h100": "sm_90a", "a100": "sm_80"}  # the PTX target the compiler must emit for the kind
# How to get each compiler, for the one-line refusal: the package extra, or the compile tier's venvs that
# .ci/accel_venvs.sh builds in a checkout (ROOT/tpu, ROOT/cuda).
TPU_INSTALL = "pip install 'd2f_jax[tpu]' (in a checkout: .ci/accel_venvs.sh ROOT, then run with ROOT/tpu/bin/python)"
CUDA_INSTALL = ("pip install 'd2f_jax[cuda12]' nvidia-cuda-nvcc-cu12 (in a checkout: .ci/accel_venvs.sh ROOT, then run "
                "with ROOT/cuda/bin/python)")


class CompilerMissing(RuntimeError):
  """The named target's compiler is not installed in this environment."""


@dataclasses.dataclass(frozen=True)
class Topology:
  """A target: device kind, device count and platform ("tpu", "cuda" or "cpu"); TPU slices also carry the
  name get_topology_desc takes (e.g. "v5p:2x4x4")."""

  name: str  # as given, e.g. "v5p-64"
  kind: str  # key of HBM_GIB
  chips: int  # JAX devices (v4 / v5p: one megacore device per chip)
  platform: str
  tpu_name: str | None = None

  @property
  def hbm_bytes(self) -> int:
    return int(HBM_GIB[self.kind] * GiB)

  @property
  def usable_bytes(self) -> int:
    return int(self.hbm_bytes * USABLE_FRACTION)


def _grid_3d(chips: int) -> list[int]:
  """v4 / v5p slice shapes: 2x2x1, 2x2x2, then double z, y, x in turn (2x2x4, 2x4x4, 4x4x4, 4x4x8 ...)."""
  if chips == 4:
    return [2, 2, 1]
  dims, axis = [2, 2, 2], 2
  while math.prod(dims) < chips:
    dims[axis] *= 2
    axis = (axis - 1) % 3
  return dims


def _grid_2d(chips: int) -> list[int]:
  """v5e / v6e slice shapes: 1x1, 2x2, 2x4, 4x4, 4x8, 8x8, 8x16, 16x16."""
  dims = [1, 1]
  while math.prod(dims) < chips:
    dims[1 if dims[0] == dims[1] else 0] *= 2
  return dims


def parse_target(name: str) -> Topology:
  """'v5p-64' (TensorCores for v4/v5p, chips for v5e/v6e, as gcloud names them), 'v5litepod-16', 'v5p:2x4x4',
  a GPU group 'h100', '8xh100', '2x8xa100', or 'cpu-8' (fake CPU devices)."""
  text = name.strip().lower()
  m = re.fullmatch(r"cpu(?:-(\d+))?", text)
  if m:
    return Topology(name, "cpu", int(m.group(1) or 1), "cpu")
  m = re.fullmatch(r"(?:(\d+)x)?(?:(\d+)x)?(a100|h100)(?:-80g)?", text)
  if m:
    counts = [int(g) for g in m.groups()[:2] if g]
    return Topology(name, m.group(3), math.prod(counts) if counts else 1, "cuda")
  m = re.fullmatch(r"(v4|v5p|v5e|v6e|v5litepod):(\d+(?:x\d+){1,2})", text)
  if m:
    kind = "v5e" if m.group(1) == "v5litepod" else m.group(1)
    dims = [int(d) for d in m.group(2).split("x")]
    return Topology(name, kind, math.prod(dims), "tpu", f"{kind}:{m.group(2)}")
  m = re.fullmatch(r"(v4|v5p|v5e|v6e|v5litepod)-(\d+)", text)
  if not m:
    raise ValueError(f"unknown target {name!r}: use e.g. v5e-8, v5p-8, v5p-64, v6e-8, v4-8, v5p:2x4x4, h100, "
                     "8xh100, a100, 8xa100, cpu-8")
  kind, count = ("v5e" if m.group(1) == "v5litepod" else m.group(1)), int(m.group(2))
  if kind in ("v4", "v5p"):  # named by TensorCores, two per chip (one megacore JAX device)
    if count < 8 or count & (count - 1):
      raise ValueError(f"target {name!r}: {kind} slices are a power of two of at least 8 TensorCores")
    chips, grid = count // 2, _grid_3d(count // 2)
  else:
    if count & (count - 1) or count > 256 or count == 2:
      raise ValueError(f"target {name!r}: {kind} slices have 1, 4, 8, 16, 32, 64, 128 or 256 chips")
    chips, grid = count, _grid_2d(count)
  return Topology(name, kind, chips, "tpu", f"{kind}:{'x'.join(map(str, grid))}")


def has_libtpu() -> bool:
  return importlib.util.find_spec("libtpu") is not None


def has_cuda_plugin() -> bool:
  try:
    return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
  except ModuleNotFoundError:  # no jax_plugins namespace at all
    return False


def gpu_target_config(kind: str) -> str:
  """The GpuTargetConfig text proto of a GPU kind (device facts: SMs, shared memory, compute capability)."""
  return importlib.resources.files("d2f_jax.aot").joinpath("targets", GPU_TARGETS[kind]).read_text()


def configure_jax(platform: str) -> None:
  """Process settings the target's compile needs; call before anything touches a JAX backend.

  This host has no accelerator: the backend that runs is the CPU one, the target's devices are compile-only.
  On NVIDIA, Pallas is lowered through Triton (0.10's default, Mosaic GPU, generates no code ahead of time).
  """
  import jax
  jax.config.update("jax_platforms", "cpu")
  if platform == "cuda":
    jax.config.update("jax_pallas_use_mosaic_gpu", False)


def devices(topology: Topology) -> list:
  """The target's devices, for jax.sharding.Mesh; raises CompilerMissing without the target's compiler."""
  from jax.experimental import topologies
  if topology.platform == "tpu":
    if not has_libtpu():
      raise CompilerMissing(f"{topology.name} needs the TPU compiler (libtpu), which this environment lacks: "
                            f"install it with {TPU_INSTALL}")
    if topology.chips == 1:  # single-chip slices are refused ("not divisible by chips_per_host_bounds")
      name = topology.tpu_name.rsplit(":", 1)[0] + (":2x2x1" if topology.kind in ("v4", "v5p") else ":2x2")
      return list(topologies.get_topology_desc(topology_name=name, platform="tpu").devices)[:1]
    return list(topologies.get_topology_desc(topology_name=topology.tpu_name, platform="tpu").devices)
  if topology.platform == "cuda":
    if not has_cuda_plugin():
      raise CompilerMissing(f"{topology.name} needs the NVIDIA compiler (jax-cuda12-plugin + nvcc), which this "
                            f"environment lacks: install it with {CUDA_INSTALL}")
    desc = topologies.get_topology_desc(platform="cuda", target_config=gpu_target_config(topology.kind),
                                        topology=f"1x1x{topology.chips}")
    return list(desc.devices)
  import jax
  found = jax.devices("cpu")
  if len(found) < topology.chips:
    raise RuntimeError(f"{topology.name}: this process has {len(found)} CPU devices; start it with "
                       f"XLA_FLAGS=--xla_force_host_platform_device_count={topology.chips}")
  return found[:topology.chips]


def cpu_device_flag(n: int) -> str:
  """XLA_FLAGS with the fake CPU device count set to n (for a child process)."""
  flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")).strip()
  return f"{flags} --xla_force_host_platform_device_count={n}".strip()


def has_compiler(target: Topology) -> bool:
  """Whether this interpreter holds `target`'s compiler (the CPU's always)."""
  return {"tpu": has_libtpu, "cuda": has_cuda_plugin}.get(target.platform, lambda: True)()


def run_with_compiler(target: Topology, venvs: str, module_args: list[str]) -> int:
  """`python -m MODULE_ARGS` in the virtual environment holding `target`'s compiler (VENVS/tpu or VENVS/cuda, as
  .ci/accel_venvs.sh builds them), this checkout first on its path; the child's exit status. Why: libtpu and
  the CUDA plugin live in separate environments, so a bench compiling for several targets hands each one whose
  compiler this interpreter lacks to a child."""
  venv = os.path.join(venvs, "tpu" if target.platform == "tpu" else "cuda")
  python = os.path.join(venv, "bin", "python")
  if not os.path.exists(python):
    raise CompilerMissing(f"{target.name} needs its compiler, missing here and in {venv} (--accel_venvs; "
                          "make it with .ci/accel_venvs.sh)")
  root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))  # the checkout: d2f_jax's parent
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
             ALLOW_MULTIPLE_LIBTPU_LOAD="1")
  return subprocess.call([python, "-m", *module_args], env=env)
