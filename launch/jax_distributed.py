"""Start `jax.distributed` from plain environment variables, then run a module as `python -m` would.

    JAX_COORDINATOR_ADDRESS=host0:1234 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=0 \
        python launch/jax_distributed.py -m d2f_jax.distill --config ... --workdir ...

`jax.distributed.initialize()` without arguments reads only the coordinator from the environment and needs
a cluster manager (SLURM, Open MPI, Kubernetes, a TPU VM) for the process count and index. On GPU hosts
started by hand (launch/gpu_host.sh) there is none, so this passes them explicitly; the trainer then finds
JAX already initialised and keeps it.
"""

from __future__ import annotations

import os
import runpy
import sys


def _env_int(name: str) -> int:
  value = os.environ.get(name)
  if value is None:
    sys.exit(f"jax_distributed.py: error: {name} is not set")
  try:
    return int(value)
  except ValueError:
    sys.exit(f"jax_distributed.py: error: {name}={value!r} is not an integer")


def main() -> None:
  if len(sys.argv) < 3 or sys.argv[1] != "-m":
    sys.exit("usage: python launch/jax_distributed.py -m MODULE [ARGS...]")
  coordinator = os.environ.get("JAX_COORDINATOR_ADDRESS")
  if not coordinator:
    sys.exit("jax_distributed.py: error: JAX_COORDINATOR_ADDRESS (host:port of process 0) is not set")
  num_processes, process_id = _env_int("JAX_NUM_PROCESSES"), _env_int("JAX_PROCESS_ID")
  if not 0 <= process_id < num_processes:
    sys.exit(f"jax_distributed.py: error: JAX_PROCESS_ID={process_id} is not in [0, {num_processes})")
  import jax
  jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)
  module = sys.argv[2]
  sys.argv = [module, *sys.argv[3:]]
  runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
  main()
