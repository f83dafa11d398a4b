"""`python -m d2f_jax.serve`: the OpenAI-compatible server (d2f_jax/serve/cli.py)."""

import sys

from d2f_jax.serve.cli import main

if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
