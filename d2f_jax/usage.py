"""A refused command-line input, the same way in every CLI: one `error: ...` line on stderr, exit status 2
(what argparse uses), never a traceback; `--help` lists every flag with its default and exits 0.

Raising a UsageError prints nothing: `command` (wrapped around every CLI's main) is the one place that prints
it, so a caller that catches it stays quiet and an in-process call of main() shows the line a user sees.
`str()` of the exception is the message. `ArgumentParser` is the argparse front end every argparse CLI uses;
`run_absl` / `parse_absl` do the same for the absl + ml_collections config-flag CLIs (main, distill, aot),
whose own handling would print usage or a traceback and exit 1, even for --help.
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
import textwrap

EXIT_BAD_INPUT = 2
HELP_FLAGS = ("-h", "--help", "-?", "--helpshort", "--helpfull")


def one_line(message) -> str:
  return " ".join(str(message).split())


class UsageError(SystemExit):
  def __init__(self, message: str):
    super().__init__(EXIT_BAD_INPUT)
    self.message = one_line(message)
    self.printed = False

  def __str__(self) -> str:
    return self.message


def command(main):
  """main, printing a UsageError it raises as the one `error:` line (once) before it exits the process."""
  @functools.wraps(main)
  def run(*args, **kwargs):
    try:
      return main(*args, **kwargs)
    except UsageError as e:
      if not e.printed:
        print(f"error: {e.message}", file=sys.stderr, flush=True)
        e.printed = True
      raise
  return run


class _Formatter(argparse.RawDescriptionHelpFormatter):
  """Keeps the description's line breaks; appends each optional flag's default unless its help says it."""

  def _get_help_string(self, action):
    text = action.help or ""
    if action.required:
      return f"{text} (required)".strip()
    if (not action.option_strings or action.default is argparse.SUPPRESS
        or "(default" in text or isinstance(action, argparse._HelpAction)):
      return text
    return f"{text} (default: %(default)s)".strip()


class ArgumentParser(argparse.ArgumentParser):
  """argparse with the module doc as description, defaults in --help and a bad flag as one `error:` line."""

  def __init__(self, prog: str, doc: str | None, **kwargs):
    super().__init__(prog=prog, description=doc, formatter_class=_Formatter, **kwargs)

  def error(self, message: str):
    raise UsageError(f"{message} (`{self.prog} --help` lists the flags)")


def _wrap(text: str) -> list[str]:
  return textwrap.wrap(text, 100, initial_indent="      ", subsequent_indent="      ")


def absl_help(doc: str, flag_values) -> str:
  """The doc and this program's flags (absl's own logging / help flags left out), each with its default."""
  from d2f_jax import config_files
  lines = [doc.strip(), "", "flags:"]
  seen = set()
  for module, module_flags in sorted(flag_values.flags_by_module_dict().items()):
    if module.startswith("absl"):
      continue
    for flag in module_flags:
      if flag.name in seen:
        continue
      seen.add(flag.name)
      default = config_files.default_of(flag)
      help_text = f"{flag.help} (default: {'none' if default is None else default})"
      lines += [f"  --{flag.name}", *_wrap(help_text)]
      if config_files.is_config_flag(flag):
        lines += [f"  --{flag.name}.FIELD=VALUE", *_wrap(
            f"override one field of the config (repeatable), e.g. --{flag.name}.seed=1; after --{flag.name} "
            "(default: the config file's values)")]
  return "\n".join(lines)


def parse_absl(argv: list[str], doc: str, flag_values=None) -> list[str]:
  """Parse argv (argv[0] the program) into absl flags: --help prints absl_help and exits 0; an unknown flag,
  a bad value, a config file that is missing or fails, or an override of a field the config lacks raises a
  UsageError naming it."""
  from absl import flags

  from d2f_jax import config_files
  flag_values = flags.FLAGS if flag_values is None else flag_values
  args = argv[1:argv.index("--")] if "--" in argv else argv[1:]
  if any(a in HELP_FLAGS for a in args):
    print(absl_help(doc, flag_values))
    raise SystemExit(0)
  for name, count in config_files.given_twice(args, flag_values):
    raise UsageError(f"--{name} given {count} times: one config per run")
  try:
    return flag_values(config_files.with_defaults(argv, flag_values))
  except flags.Error as e:
    missing = re.search(r"Flag (--\S+) must have a value other than None", str(e))
    raise UsageError(f"{missing.group(1)} is required" if missing else str(e)) from None
  except (KeyError, AttributeError, TypeError, ValueError, OSError) as e:  # from ml_collections' override code
    raise UsageError(f"{' '.join(a for a in args if '.' in a.split('=')[0])}: {type(e).__name__}: {e}") from None


@command
def run_absl(main, doc: str, argv: list[str] | None = None) -> None:
  """absl's app.run (its logging set-up, then main) with parse_absl as the flag parser."""
  from absl import app
  app.run(main, argv=argv, flags_parser=lambda a: parse_absl(a, doc))
