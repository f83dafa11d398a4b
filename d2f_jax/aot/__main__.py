import sys

from d2f_jax.aot.cli import main

sys.exit(main())
