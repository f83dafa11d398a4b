"""The persistent compilation cache of the command-line programs (d2f_jax/compilation_cache.py): on by default
on GPU / TPU only, a directory or 'off' by flag, and really used by JAX once a CLI has set it up."""

import os
import subprocess
import sys
import textwrap

import pytest

from d2f_jax import compilation_cache as cc


def test_auto_is_on_for_accelerators_only_and_follows_the_environment(tmp_path):
  home_default = os.path.abspath(os.path.expanduser(cc.DEFAULT_DIR))
  assert cc.cache_dir("auto", "cpu", environ={}) is None
  for platform in ("tpu", "gpu", "cuda"):
    assert cc.cache_dir("auto", platform, environ={}) == home_default
  assert cc.cache_dir("auto", "tpu", environ={cc.ENV: str(tmp_path)}) == str(tmp_path)
  for off in ("off", "", " "):
    assert cc.cache_dir("auto", "tpu", environ={cc.ENV: off}) is None
  assert cc.cache_dir("off", "tpu", environ={}) is None
  # A directory given by flag is used on any platform, the environment notwithstanding.
  assert cc.cache_dir(str(tmp_path / "c"), "cpu", environ={cc.ENV: "off"}) == str(tmp_path / "c")
  with pytest.raises(ValueError, match="'auto', 'off' or a directory, got ''"):
    cc.cache_dir("", "cpu")


def test_a_directory_that_cannot_be_made_is_refused_by_name(tmp_path):
  import argparse
  import jax
  from d2f_jax.decode.flags import add_device_flags, setup_devices
  blocker = tmp_path / "a_file"
  blocker.write_text("not a directory")
  parser = argparse.ArgumentParser()
  add_device_flags(parser)
  args = parser.parse_args(["--distributed", "off", "--compilation_cache", str(blocker / "xla")])
  before = jax.config.jax_compilation_cache_dir
  with pytest.raises(SystemExit, match=f"--compilation_cache {blocker / 'xla'}: cannot create the directory") as stop:
    setup_devices(args)
  assert stop.value.code == 2 and jax.config.jax_compilation_cache_dir == before  # refused before it is set


def test_the_flag_sets_up_a_cache_jax_writes_to(tmp_path):
  """In a child process (the setting is process-wide): the CLIs' device setup points JAX at the directory,
  and a compiled program lands there."""
  cache = tmp_path / "xla"
  script = textwrap.dedent(f"""
      import argparse, jax, jax.numpy as jnp
      from d2f_jax.decode.flags import add_device_flags, setup_devices
      p = argparse.ArgumentParser()
      add_device_flags(p)
      setup_devices(p.parse_args(["--distributed", "off", "--compilation_cache", {str(cache)!r}]))
      print("dir", jax.config.jax_compilation_cache_dir)
      jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # tiny programs compile fast
      print(jax.jit(lambda x: jnp.sin(x) * 3)(jnp.arange(4.0)).sum())
  """)
  done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                        env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert done.returncode == 0, done.stderr[-2000:]
  assert f"dir {cache}" in done.stdout
  assert any(cache.iterdir()), "no compiled program was written to the cache"
