"""`python -m d2f_jax.convert --help` (exit status: 0 ok, 2 refused input, 143 SIGTERM; see cli.py)."""

import sys

from d2f_jax.convert.cli import main

if __name__ == "__main__":
  main(sys.argv[1:])
