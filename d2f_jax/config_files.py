"""`--config configs/x.py[:arg]` in a checkout and after a plain (non-editable) `pip install`.

The repository's top-level configs/ directory is packaged as `d2f_jax.configs` (pyproject's package-dir
mapping), so an installed package carries the configs it documents. A config path that does not exist
relative to the working directory, and names `configs/<file>.py`, resolves to that packaged file; a path
that exists is always used as given, so a user's own config files work as before.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import re
import sys

from absl import flags
from ml_collections import config_flags
from ml_collections.config_dict import ConfigDict
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
  """ml_collections' config-file parser on the resolved path, whose failures name the file: a missing file
  (ml_collections would defer that to the first access of the config), an exception of get_config (e.g. an
  unknown `:arg`), and an override `--name.FIELD` of a field the config lacks (a KeyError deep in
  ml_collections otherwise). Raised as ValueError, which absl reports as a bad value of the flag."""

  def __init__(self, name: str, lock_config: bool, argv):
    super().__init__(name=name, lock_config=lock_config)
    self._argv = argv

  def parse(self, path):
    spec = resolve(path)
    file = spec.partition(":")[0]
    if not os.path.isfile(file):
      raise ValueError(f"config file {file!r} does not exist (expected a .py file with get_config(), e.g. "
                       "configs/tiny_e2e.py)")
    try:
      config = super().parse(spec)
    except Exception as e:  # noqa: BLE001 - a user's config file may raise anything; its last line says what
      lines = [line for line in str(e).splitlines() if line.strip()]
      raise ValueError(lines[-1].strip() if lines else type(e).__name__) from None  # absl prefixes the flag
    self._check_overrides(config)
    return config

  def _check_overrides(self, config) -> None:
    for arg in self._argv():
      match = re.match(rf"^--?(?:no)?{re.escape(self.name)}\.([^=]+)", arg)
      if not match:
        continue
      current, walked = config, []
      for part in match.group(1).split("."):
        if not isinstance(current, ConfigDict):
          break  # a value of another kind: ml_collections checks what it accepts
        if part not in current:
          close = difflib.get_close_matches(part, [str(k) for k in current.keys()], n=1)
          hint = (f"did you mean --{self.name}.{'.'.join(walked + close)}?" if close
                  else f"its fields there: {', '.join(sorted(map(str, current.keys())))}")
          raise ValueError(f"--{self.name}.{match.group(1)}: the config has no field "
                           f"{'.'.join(walked + [part])!r}; {hint}")
        walked.append(part)
        current = current[part]


def DEFINE_config_file(name: str, default: str | None, help_string: str, *, flag_values=flags.FLAGS,  # noqa: N802
                       sys_argv: list[str] | None = None, lock_config: bool = True) -> flags.FlagHolder:
  """config_flags.DEFINE_config_file whose path also finds the packaged configs (see the module doc).

  Nothing is parsed at definition (ml_collections would parse the default then, with the overrides of
  sys.argv, at import, where a bad override is a traceback): `with_defaults` puts `--name=default` on the
  command line when it is absent, so the default is parsed with the other flags. `sys_argv`: the command
  line the overrides are read from (default sys.argv), for a parse of another argv in-process."""
  holder = config_flags.DEFINE_config_file(name, None, help_string, flag_values=flag_values,
                                           lock_config=lock_config, sys_argv=sys_argv)
  flag = flag_values[name]
  flag.parser = _ResolvingParser(name, lock_config, lambda: sys.argv if sys_argv is None else sys_argv)
  flag.d2f_default = None if default is None else resolve(default)
  return holder


def is_config_flag(flag) -> bool:
  return isinstance(flag.parser, _ResolvingParser)


def default_of(flag) -> str | None:
  """A flag's default as --help shows it (a config flag's is its file, never parsed before use)."""
  if is_config_flag(flag):
    return getattr(flag, "d2f_default", None)
  if flag.default is None:
    return None
  if isinstance(flag.default, bool):
    return str(flag.default).lower()
  return ",".join(map(str, flag.default)) if isinstance(flag.default, list) else str(flag.default)


def _given(args: list[str], name: str) -> int:
  return sum(bool(re.match(rf"^--?{re.escape(name)}(=|$)", a)) for a in args)


def given_twice(args: list[str], flag_values) -> list[tuple[str, int]]:
  """(name, count) of each config flag given more than once (absl would keep the last one silently)."""
  return [(name, _given(args, name)) for name in flag_values
          if is_config_flag(flag_values[name]) and _given(args, name) > 1]


def with_defaults(argv: list[str], flag_values) -> list[str]:
  """argv with `--name=default` added for each config flag that has a default and is not given."""
  added = []
  for name in flag_values:
    flag = flag_values[name]
    if is_config_flag(flag) and getattr(flag, "d2f_default", None) and not _given(argv[1:], name):
      added.append(f"--{name}={flag.d2f_default}")
  return argv[:1] + added + argv[1:]
