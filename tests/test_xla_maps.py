"""A long-lived process stays under Linux's cap on memory mappings (d2f_jax/xla_maps.py).

The crash this guards against (jaxlib 0.10.2, XLA:CPU): every compiled kernel is mapped on its own, so each
`generate` program of the tiny test models holds ~1,000 mappings and JAX keeps them while the function lives.
Minimal reproduction (about 100 s, then the process dies):

    m = sharp_model("llada")  # tests/test_decode.py
    for i in range(1, 200):   # ~1,100 more mappings each; /proc/self/maps reaches 65530 near i = 58
      generate(m, [[1, 2, 3]], DecodeConfig(block_size=4, max_new_tokens=4 * i, prompt_buckets=8))

prints "LLVM compilation error: Cannot allocate memory" from XLA's JIT threads, then dies by SIGSEGV in
libgcc's unwinder (`_Unwind_RaiseException` -> `_Unwind_Find_FDE`) while jaxlib throws the compile's
"INTERNAL: Failed to materialize symbols" as a C++ exception; some runs die by SIGABRT instead. A full test
worker reached the cap the same way (65103 mappings in its core dump) and crashed in a different test each
time: tests/test_serve_engine.py's old rerun marker hid it. It runs too long to run here; the cases below drive
the guard with a lower cap ($D2F_MAX_MAP_COUNT) in a child process instead.
"""

import os
import subprocess
import sys

import pytest

from d2f_jax import xla_maps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import logging, os, sys
sys.path.insert(0, {tests!r})
import jax
jax.config.update("jax_disable_most_optimizations", True)
from d2f_jax import xla_maps
from d2f_jax.decode import DecodeConfig, generate
from test_decode import sharp_model
logging.basicConfig(level=logging.WARNING, format="%(message)s")
model = sharp_model("llada")
base = xla_maps.mapping_count()
os.environ[xla_maps.LIMIT_ENV] = str(base + {room})
config = lambda i: DecodeConfig(block_size=4, max_new_tokens=4 * i, prompt_buckets=8)
first, peak = [], 0
for i in range(1, 9):
  xla_maps._last_check[0] = 0.0  # check before every call (the guard skips checks 0.25 s apart)
  first.append(generate(model, [[1, 2, 3]], config(i)).to_lists())
  peak = max(peak, xla_maps.mapping_count() - base)
again = [generate(model, [[1, 2, 3]], config(i)).to_lists() for i in range(1, 9)]
print("RESULT", peak, first == again, flush=True)
"""


def _child(room: int) -> subprocess.CompletedProcess:
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  env.pop(xla_maps.LIMIT_ENV, None)
  return subprocess.run([sys.executable, "-c", CHILD.format(tests=os.path.join(ROOT, "tests"), room=room)],
                        capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.skipif(xla_maps.mapping_count() is None, reason="needs Linux's /proc/self/maps")
def test_a_process_compiling_program_after_program_frees_them_before_the_cap():
  """Eight decode programs of ~1,000 mappings each against a cap 20,000 above the start (reserve 16,384): the
  guard frees the compiled programs whenever fewer than the reserve remain, the process never holds more
  than the cap allows, and the programs compiled again decode the same tokens."""
  done = _child(20000)
  assert done.returncode == 0, done.stderr[-3000:]
  peak, same = done.stdout.split("RESULT")[1].split()
  assert "freed JAX's compiled programs" in done.stderr and "recompile when next called" in done.stderr
  assert int(peak) < 20000 and same == "True", done.stdout


@pytest.mark.skipif(xla_maps.mapping_count() is None, reason="needs Linux's /proc/self/maps")
def test_a_cap_too_low_even_after_freeing_is_refused_naming_the_setting():
  done = _child(100)
  assert done.returncode != 0
  assert "RuntimeError: this process holds" in done.stderr and "vm.max_map_count=262144" in done.stderr


def test_the_cap_and_the_count(monkeypatch):
  monkeypatch.setenv(xla_maps.LIMIT_ENV, "1234")
  assert xla_maps.mapping_limit() == 1234
  monkeypatch.setenv(xla_maps.LIMIT_ENV, "many")
  with pytest.raises(ValueError, match=r"\$D2F_MAX_MAP_COUNT must be an integer, got 'many'"):
    xla_maps.mapping_limit()
  monkeypatch.delenv(xla_maps.LIMIT_ENV)
  if xla_maps.mapping_count() is not None:  # Linux: the kernel's cap, and far from it here
    assert xla_maps.mapping_limit() > 0 and not xla_maps.ensure_headroom(force=True)
