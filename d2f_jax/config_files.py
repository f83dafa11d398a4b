"""`--config configs/x.py[:arg]` in a checkout and after a plain (non-editable) `pip install`.

The repository's top-level configs/ directory is packaged as `d2f_jax.configs` (pyproject's package-dir
mapping), so an installed package carries the configs it documents. A config path that does not exist
relative to the working directory, and names `configs/<file>.py`, resolves to that packaged file; a path
that exists is always used as given, so a user's own config files work as before.
"""

from __future__ import annotations

import importlib.util
import os

from absl import flags
from ml_collections import config_flags
from ml_collections.config_flags.config_flags import ConfigFileFlagParser

_CHECKOUT_CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def packaged_dir() -> str | None:
  """The installed d2f_jax/configs directory, or the checkout's configs/ beside the package."""
  spec = importlib.util.find_spec("d2f_jax.configs")
  if spec is not None and spec.submodule_search_locations:
    return list(spec.submodule_search_locations)[0]
  return _CHECKOUT_CONFIGS if os.path.isdir(_CHECKOUT_CONFIGS) else None


def resolve(path_and_arg: str) -> str:
  """'path.py[:arg]' with the path made to exist where it can: as given, else the packaged configs/<file>."""
  path, colon, arg = path_and_arg.partition(":")
  if os.path.isfile(path):
    return path_and_arg
  parent, name = os.path.split(os.path.normpath(path))
  directory = packaged_dir()
  if directory and (os.path.basename(parent) == "configs" or not parent):
    candidate = os.path.join(directory, name)
    if os.path.isfile(candidate):
      return candidate + colon + arg
  return path_and_arg


class _ResolvingParser(ConfigFileFlagParser):
  """ml_collections' config-file parser, on the resolved path."""

  def parse(self, path):
    return super().parse(resolve(path))


def DEFINE_config_file(name: str, default: str | None, help_string: str, **kwargs) -> flags.FlagHolder:  # noqa: N802
  """config_flags.DEFINE_config_file whose path also finds the packaged configs (see the module doc)."""
  # The default is resolved before ml_collections parses it at definition time: that parse also defines the
  # `--name.field=value` override flags, bound to the config it returns, so re-parsing the default afterwards
  # would leave the overrides writing into a config nobody reads.
  holder = config_flags.DEFINE_config_file(name, None if default is None else resolve(default), help_string,
                                           **kwargs)
  flags.FLAGS[name].parser = _ResolvingParser(name=name, lock_config=kwargs.get("lock_config", True))
  return holder
