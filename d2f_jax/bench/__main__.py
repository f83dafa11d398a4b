"""Dispatch `python -m d2f_jax.bench <name> [flags]` to `d2f_jax.bench.<name>.main(flags)`."""

import ast
import importlib
import importlib.util
import sys

from d2f_jax.bench import BENCHMARKS
from d2f_jax.usage import UsageError, command


def _summary(name: str) -> str:
  """The first line of a benchmark's module doc, read without importing it (no JAX start for --help)."""
  spec = importlib.util.find_spec(f"d2f_jax.bench.{name}")
  if spec is None or not spec.origin:
    return "(not in this checkout)"
  with open(spec.origin) as f:
    doc = ast.get_docstring(ast.parse(f.read())) or ""
  return doc.split("\n\n")[0].replace("\n", " ")


def usage_text() -> str:
  lines = [f"usage: python -m d2f_jax.bench {{{','.join(BENCHMARKS)}}} [flags]", "",
           "Benchmarks print a table and write JSON under results/. `python -m d2f_jax.bench NAME --help` lists "
           "a benchmark's flags and their defaults.", "", "benchmarks:"]
  return "\n".join(lines + [f"  {name:<10} {_summary(name)}" for name in BENCHMARKS])


@command
def main(argv: list[str]) -> None:
  if argv and argv[0] in ("-h", "--help"):
    print(usage_text())
    return
  if not argv:
    raise UsageError(f"name a benchmark: one of {', '.join(BENCHMARKS)} (`python -m d2f_jax.bench --help`)")
  name, rest = argv[0], argv[1:]
  if name not in BENCHMARKS:
    raise UsageError(f"unknown benchmark {name!r}; choose one of {', '.join(BENCHMARKS)}")
  try:
    module = importlib.import_module(f"d2f_jax.bench.{name}")
  except ModuleNotFoundError as e:
    if e.name == f"d2f_jax.bench.{name}":
      raise UsageError(f"benchmark {name!r} is not implemented yet in this checkout") from None
    raise
  status = module.main(rest)
  if isinstance(status, int) and not isinstance(status, bool):  # an exit status (cost, device)
    sys.exit(status)


if __name__ == "__main__":
  main(sys.argv[1:])
