"""Dispatch `python -m d2f_jax.bench <name> [flags]` to `d2f_jax.bench.<name>.main(flags)`."""

import importlib
import sys

from d2f_jax.bench import BENCHMARKS


def main(argv: list[str]) -> None:
  if not argv or argv[0] in ("-h", "--help"):
    print(f"usage: python -m d2f_jax.bench {{{','.join(BENCHMARKS)}}} [flags]")
    sys.exit(0 if argv else 2)
  name, rest = argv[0], argv[1:]
  if name not in BENCHMARKS:
    sys.exit(f"unknown benchmark {name!r}; choose one of {', '.join(BENCHMARKS)}")
  try:
    module = importlib.import_module(f"d2f_jax.bench.{name}")
  except ModuleNotFoundError as e:
    if e.name == f"d2f_jax.bench.{name}":
      sys.exit(f"benchmark {name!r} is not implemented yet in this checkout")
    raise
  status = module.main(rest)
  if isinstance(status, int) and not isinstance(status, bool):  # an exit status (cost, device)
    sys.exit(status)


if __name__ == "__main__":
  main(sys.argv[1:])
