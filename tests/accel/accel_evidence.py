"""Which accelerator compilers this environment has, and what a compile left behind that shows the backend
generated the kernels: names of the Mosaic custom calls in an optimised TPU HLO module, and the PTX targets /
entries in an XLA dump directory (--xla_dump_to)."""

from __future__ import annotations

import importlib.util
import pathlib
import re

WINDOW_KERNELS = frozenset({"d2f_window_attention"})
FLASH_KERNELS = frozenset({"d2f_flash_forward", "d2f_flash_backward_dkv", "d2f_flash_backward_dq"})


def has_compiler(name: str) -> bool:
  """Whether this environment has the "tpu" (libtpu) or "cuda" (jax-cuda12-plugin) compiler."""
  if name == "tpu":
    return importlib.util.find_spec("libtpu") is not None
  try:
    return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
  except ModuleNotFoundError:  # no jax_plugins namespace package at all
    return False


def tpu_kernel_calls(hlo_text: str) -> set[str]:
  """Names of the Mosaic kernels (tpu_custom_call instructions, named after the kernel) in a TPU HLO module."""
  names = set()
  for line in hlo_text.splitlines():
    if 'custom_call_target="tpu_custom_call"' in line:
      m = re.match(r"\s*(?:ROOT\s+)?%?([A-Za-z_][\w-]*?)(?:\.\d+)?\s*=", line)
      names.add(m.group(1) if m else line.strip()[:80])
  return names


def _kernel_name(entry: str) -> str:
  """PTX entry -> kernel name: Triton suffixes further specialisations with underscores (d2f_flash_forward__)."""
  return re.sub(r"_+\d*$", "", entry)


def ptx_entries(paths) -> dict[str, set[str]]:
  """{PTX .target: kernel names of the .entry functions in the files with that target}."""
  found: dict[str, set[str]] = {}
  for path in paths:
    text = pathlib.Path(path).read_text()
    target = re.search(r"^\.target\s+([\w.]+)", text, re.M)
    if target:
      entries = re.findall(r"^\s*(?:\.visible\s+)?\.entry\s+([A-Za-z_$][\w$]*)", text, re.M)
      found.setdefault(target.group(1), set()).update(_kernel_name(e) for e in entries)
  return found


def device_modules(dump_dir: pathlib.Path, platform: str) -> list[tuple[int, str]]:
  """(module id, module name) of the modules compiled for the accelerator (not the host's small CPU jits),
  in compile order."""
  if platform == "tpu":
    pattern = re.compile(r"module_(\d+)\.(.+?)\.after_optimizations\.txt$")
  else:
    pattern = re.compile(r"module_(\d+)\.(.+?)\.sm_[\w.]+_gpu_after_optimizations\.txt$")
  found = {}
  for path in dump_dir.iterdir():
    m = pattern.match(path.name)
    if m:
      found[int(m.group(1))] = m.group(2)
  return sorted(found.items())


def module_kernels(dump_dir: pathlib.Path, platform: str, module_id: int) -> tuple[set[str], set[str]]:
  """(kernel names, PTX targets, empty on TPU) of one dumped module. Only names starting d2f_ count: the
  project's kernels (XLA's own fusions also become PTX entries)."""
  prefix = f"module_{module_id:04d}."
  if platform == "tpu":
    (hlo,) = [p for p in dump_dir.glob(prefix + "*.after_optimizations.txt")]
    return {n for n in tpu_kernel_calls(hlo.read_text()) if n.startswith("d2f_")}, set()
  entries = ptx_entries(dump_dir.glob(prefix + "*.ptx"))
  return {n for names in entries.values() for n in names if n.startswith("d2f_")}, set(entries)
