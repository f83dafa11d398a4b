"""Run many `python -m d2f_jax.X ARGS` command lines in one subprocess: the heavy libraries are imported once,
then each command line runs in a forked child exactly as `python -m` runs it (runpy, run_name "__main__",
fresh absl flags, its own stdout / stderr and exit status). Used by tests/test_cli.py to keep every CLI's
--help and refusals under a minute on a busy 2-core machine.

  python tests/cli_cases.py < cases.json > results.json   # cases: [[module, [args...]], ...]
"""

import json
import os
import runpy
import sys
import tempfile
import traceback


def _child(module: str, args: list[str], out: str, err: str) -> None:
  for fd, path in ((1, out), (2, err)):
    os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
  sys.argv = [module, *args]
  code = 0
  try:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
  except SystemExit as e:  # what the interpreter does with it
    code = e.code
    if isinstance(code, str):
      print(code, file=sys.stderr)
      code = 1
  except BaseException:  # noqa: BLE001 - an uncaught exception: the traceback a user would see
    traceback.print_exc()
    code = 1
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code or 0)


def main() -> None:
  cases = json.load(sys.stdin)
  import absl.flags  # noqa: F401 - imported once here, shared by every forked command line
  import jax  # noqa: F401
  import ml_collections  # noqa: F401
  import d2f_jax.decode  # noqa: F401
  results = []
  with tempfile.TemporaryDirectory() as tmp:
    out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
    for module, args in cases:
      pid = os.fork()
      if pid == 0:
        _child(module, args, out, err)
      _, status = os.waitpid(pid, 0)
      with open(out) as f_out, open(err) as f_err:
        results.append({"module": module, "args": args, "code": os.waitstatus_to_exitcode(status),
                        "out": f_out.read(), "err": f_err.read()})
  json.dump(results, sys.__stdout__)


if __name__ == "__main__":
  main()
