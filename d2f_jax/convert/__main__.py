"""`python -m d2f_jax.convert --help`."""

import sys

from d2f_jax.convert.cli import main

if __name__ == "__main__":
  try:
    main(sys.argv[1:])
  except (ValueError, FileNotFoundError, FileExistsError) as e:  # our errors name the file / tensor / field
    sys.exit(f"error: {e}")
