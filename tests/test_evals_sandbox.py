"""The execution sandbox behind HumanEval: real tasks pass, and each limit stops what it should."""

import os
import shutil
import tempfile
import time
import uuid

import pytest

from d2f_jax.evals.humaneval import build_program, load_problems
from d2f_jax.evals.sandbox import Sandbox, network_namespace_available, world_executable


@pytest.fixture(scope="module")
def sandbox():
  return Sandbox(timeout_s=2.0, memory_mb=512, file_mb=4)


@pytest.fixture(scope="module")
def problems():
  return {p["task_id"]: p for p in load_problems()}


@pytest.mark.parametrize("task_id", ["HumanEval/0", "HumanEval/53", "HumanEval/162"])  # 162 needs hashlib
def test_canonical_solution_passes(sandbox, problems, task_id):
  problem = problems[task_id]
  result = sandbox.run(build_program(problem, problem["canonical_solution"]))
  assert result.passed, result.stderr


def test_wrong_solution_fails_with_the_assertion(sandbox, problems):
  problem = problems["HumanEval/53"]  # add(x, y)
  result = sandbox.run(build_program(problem, "    return x - y\n"))
  assert result.status == "failed" and "AssertionError" in result.reason


def test_exiting_before_the_checks_is_not_a_pass(sandbox):
  for code in ("import sys; sys.exit(0)", "import os; os._exit(0)", "raise SystemExit"):
    assert sandbox.run(code + "\nassert False\n").status == "failed"


def test_infinite_loop_is_killed_by_the_timeout(sandbox):
  result = sandbox.run("while True:\n  pass\n")
  assert result.status == "timeout" and "timed out" in result.reason
  assert 1.9 < result.seconds < 6.0


@pytest.mark.parametrize("how", ["open", "pathlib", "os.open", "os.system", "shutil.move"])
def test_writes_outside_the_directory_fail(sandbox, how):
  target = f"/tmp/escape_{uuid.uuid4().hex}"
  code = {"open": f"open({target!r}, 'w').write('x')",
          "pathlib": f"import pathlib; pathlib.Path({target!r}).write_text('x')",
          "os.open": f"import os; os.close(os.open({target!r}, os.O_CREAT | os.O_WRONLY))",
          "os.system": f"import os; os.system('touch {target}')",
          "shutil.move": f"import shutil; open('inside', 'w').write('x'); shutil.move('inside', {target!r})"}[how]
  result = sandbox.run(code)
  assert result.status == "failed" and "sandbox" in result.reason
  assert not os.path.exists(target)


def test_files_inside_the_directory_are_allowed_and_removed(sandbox):
  code = ("import os, shutil\nopen('a.txt', 'w').write('hi')\nos.mkdir('d')\nos.rename('a.txt', 'd/b.txt')\n"
          "assert open('d/b.txt').read() == 'hi'\nshutil.rmtree('d')\nprint(os.getcwd())\n")
  result = sandbox.run(code)
  assert result.passed, result.stderr
  assert not os.path.exists(result.stdout.strip())  # the working directory is deleted afterwards


def test_deleting_outside_the_directory_fails(sandbox, tmp_path):
  keep = tmp_path / "keep.txt"
  keep.write_text("x")
  for code in (f"import os; os.remove({str(keep)!r})", f"import shutil; shutil.rmtree({str(tmp_path)!r})"):
    assert sandbox.run(code).status == "failed"
  assert keep.read_text() == "x"


def test_too_much_memory_fails(sandbox):
  result = sandbox.run("block = bytearray(2 * 1024 ** 3)\n")
  assert result.status == "failed" and "MemoryError" in result.reason


def test_too_large_a_file_fails(sandbox):
  result = sandbox.run("with open('big', 'wb') as f:\n  for _ in range(64):\n    f.write(b'x' * (1 << 20))\n")
  assert result.status == "failed"
  assert "File too large" in result.reason or "SIGXFSZ" in result.reason


def test_opening_a_socket_fails(sandbox):
  result = sandbox.run("import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_STREAM)\n")
  assert result.status == "failed" and "network" in result.reason


@pytest.mark.skipif(not network_namespace_available(), reason="needs root and a working `unshare -n`")
def test_network_namespace_blocks_sockets_without_the_python_guard():
  sandbox = Sandbox(timeout_s=5.0, guards=False, network_namespace=True)
  code = "import socket\ns = socket.socket()\ns.settimeout(3)\ns.connect(('10.255.255.1', 9))\n"
  result = sandbox.run(code)
  assert result.status == "failed" and "unreachable" in result.reason.lower()


@pytest.mark.skipif(os.geteuid() != 0 or not world_executable("/usr/bin/python3"),
                    reason="needs root and a system interpreter that `nobody` can run")
def test_running_as_nobody_protects_root_files_without_the_python_guard():
  protected = tempfile.mkdtemp(prefix="d2f_protected_")  # root-owned, readable by all, writable by root only
  try:
    os.chmod(protected, 0o755)
    sandbox = Sandbox(timeout_s=5.0, guards=False, drop_privileges=True, python="/usr/bin/python3")
    target = os.path.join(protected, "x")
    result = sandbox.run(f"import os\nprint(os.getuid(), os.listdir({protected!r}))\nopen({target!r}, 'w')\n")
    assert result.status == "failed" and "Permission denied" in result.reason
    assert result.stdout.split()[0] == "65534" and not os.path.exists(target)
  finally:
    shutil.rmtree(protected)


def test_timeout_kills_processes_the_program_started(tmp_path):
  sandbox = Sandbox(timeout_s=1.5, guards=False)
  code = "import subprocess\np = subprocess.Popen(['sleep', '60'])\nprint(p.pid, flush=True)\nwhile True:\n  pass\n"
  result = sandbox.run(code)
  assert result.status == "timeout"
  pid = int(result.stdout.split()[0])
  # SIGKILL is delivered asynchronously: give the kernel a moment, then the child must be dead
  # (gone, or a zombie waiting for init). A recycled pid would no longer be our `sleep 60`.
  deadline = time.monotonic() + 5.0
  while time.monotonic() < deadline and _alive_sleep(pid):
    time.sleep(0.05)
  assert not _alive_sleep(pid)


def _alive_sleep(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
      cmdline = f.read()
    with open(f"/proc/{pid}/status") as f:
      state = next(line for line in f if line.startswith("State:"))
  except (FileNotFoundError, ProcessLookupError):
    return False
  return cmdline.startswith(b"sleep") and "Z" not in state


def test_bad_limits_are_rejected():
  with pytest.raises(ValueError, match="timeout_s"):
    Sandbox(timeout_s=0)
  with pytest.raises(ValueError, match="memory_mb must be a positive int, got -1"):
    Sandbox(memory_mb=-1)
  with pytest.raises(ValueError, match="file_mb"):
    Sandbox(file_mb=1.5)
  with pytest.raises(ValueError, match="not an executable"):
    Sandbox(python="/nonexistent/python")
