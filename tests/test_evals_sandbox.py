"""The execution sandbox behind HumanEval, tried as an attacker would: each test checks the verdict and that
nothing outside the sandbox changed. Runs under `pytest -n 2`: every path, port and marker is unique."""

import os
import socket
import subprocess
import time
import uuid
import warnings
from pathlib import Path

import pytest

from d2f_jax.evals.sandbox import bwrap
from d2f_jax.evals.humaneval import build_program, build_test, load_problems
from d2f_jax.evals.sandbox import (BubblewrapUnavailable, ProcessIsolationWarning, Sandbox, TestProgram,
                                   bubblewrap_unavailable_reason)

REASON = bubblewrap_unavailable_reason()
needs_bwrap = pytest.mark.skipif(REASON is not None, reason=f"bubblewrap cannot run here: {REASON}")
CHECKOUT_FILE = Path(__file__).resolve()
MAX_PROCESSES = 12


# A run that ends by itself must get its verdict however loaded the host is: on CI's two shared cores a 0.5 s
# memory bomb once ran past a 4 s wall limit and was judged 'timeout'. Work that never ends gets SHORT_TIMEOUT_S.
ROOMY_TIMEOUT_S = 60.0
SHORT_TIMEOUT_S = 2.0


def _bubblewrap_box(timeout_s: float) -> Sandbox:
  return Sandbox(timeout_s=timeout_s, memory_mb=512, file_mb=4, tmpfs_mb=16, max_processes=MAX_PROCESSES)


@pytest.fixture(scope="module")
def sandbox():
  if REASON is not None:
    pytest.skip(f"bubblewrap cannot run here: {REASON}")
  return _bubblewrap_box(ROOMY_TIMEOUT_S)


@pytest.fixture(scope="module")
def problems(fixture_data_dir):
  """The project's own HumanEval-format problems (tests/fixtures/benchmark_data.py)."""
  return {p["task_id"]: p for p in load_problems(str(fixture_data_dir / "HumanEval.jsonl.gz"))}


@pytest.fixture
def host(tmp_path):
  """A directory on the host with a file in it, and a check that neither changed (nor anything appeared)."""
  keep = tmp_path / "keep.txt"
  keep.write_text("original")
  target = tmp_path / f"written_{uuid.uuid4().hex}"

  def unchanged():
    assert keep.read_text() == "original"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]
    assert not Path(f"/tmp/{target.name}").exists()
    return True

  return {"dir": str(tmp_path), "keep": str(keep), "target": str(target), "unchanged": unchanged}


ADD_TASK = "Fixture/4"  # add(x, y) with 100 random checks, as HumanEval/53 is


def judge(sandbox, problems, completion, task_id=ADD_TASK):
  return sandbox.run_test(build_test(problems[task_id], completion))


# --- the verdict: forgeries fail ---------------------------------------------------------------------

FORGERIES = {
    "posix._exit in the call": "    import posix; posix._exit(0)\n",
    "os._exit at load": "    return x + y\nimport os\nos._exit(0)\n",
    "sys.exit in the call": "    import sys; sys.exit(0)\n",
    "SystemExit(0) at load": "    return x + y\nraise SystemExit(0)\n",
    "kill the parent": "    import os, posix; posix.kill(os.getppid(), 9)\n",
    "kill everything it may": "    import os; os.kill(-1, 9)\n",
    "print the token format": "    print('0123456789abcdef0123456789abcdef', flush=True)\n    return 0\n",
    "write tokens to every fd": ("    import os, secrets\n    for fd in range(3, 256):\n        try:\n"
                                 "            os.write(fd, secrets.token_hex(16).encode())\n"
                                 "        except OSError:\n            pass\n    return 0\n"),
    "search gc and frames for the token": (
        "    import gc, sys\n    found = [o for o in gc.get_objects() if isinstance(o, dict) and 'token' in o]\n"
        "    f = sys._getframe()\n    while f:\n"
        "        found += [v for v in f.f_locals.values() if isinstance(v, dict)]\n"
        "        f = f.f_back\n    assert not any('token' in d for d in found), found\n    return 0\n"),
    "an always-equal result": ("    class Eq:\n        def __eq__(self, other):\n            return True\n"
                               "    return Eq()\n"),
    "an int subclass that equals all": ("    class Eq(int):\n        def __eq__(self, other):\n"
                                        "            return True\n    return Eq(0)\n"),
    "patch builtins and check": ("    return 0\nimport builtins\n"
                                 "builtins.AssertionError = type('Quiet', (Exception,), {})\n"
                                 "check = lambda candidate: None\nbuiltins.check = check\n"),
    "trace and skip the asserts": ("    import sys\n    caller = sys._getframe(1)\n"
                                   "    def jump(frame, event, arg):\n        return jump\n"
                                   "    caller.f_trace = jump\n    sys.settrace(jump)\n    return 0\n"),
    "garbage on its pipe": ("    import os\n    for fd in range(3, 64):\n        try:\n"
                            "            os.write(fd, b'\\x00\\x00\\x00\\x02[]')\n        except OSError:\n"
                            "            pass\n    return 0\n"),
}


@pytest.mark.parametrize("how", sorted(FORGERIES))
def test_forged_passes_fail(sandbox, problems, host, how):
  result = judge(sandbox, problems, FORGERIES[how])
  assert result.status == "failed", (how, result)
  assert host["unchanged"]()
  assert judge(sandbox, problems, "    return x + y\n").passed  # the evaluation goes on afterwards


def test_a_correct_completion_passes_and_a_wrong_one_fails(sandbox, problems):
  assert judge(sandbox, problems, "    return x + y\n").passed
  wrong = judge(sandbox, problems, "    return x - y\n")
  assert wrong.status == "failed" and "AssertionError" in wrong.reason
  broken = judge(sandbox, problems, "    return x +\n")
  assert broken.status == "failed" and "did not load" in broken.reason


def _canonical_solutions_pass(sandbox, problems):
  start = time.perf_counter()
  results = sandbox.run_many([build_test(p, p["canonical_solution"]) for p in problems.values()], workers=2)
  failed = [(task, r.reason) for task, r in zip(problems, results) if not r.passed]
  assert not failed, failed
  print(f"{len(problems)} canonical solutions judged in {time.perf_counter() - start:.1f}s")


def test_canonical_solutions_of_the_fixture_problems_pass(sandbox, problems):
  """Helpers defined in the prompt, a test that names the entry point itself, typing imports."""
  _canonical_solutions_pass(sandbox, problems)


@pytest.mark.real_data("HumanEval.jsonl.gz")
def test_canonical_solutions_of_all_164_problems_pass(sandbox):
  problems = {p["task_id"]: p for p in load_problems()}  # the real file, from the data directory
  assert len(problems) == 164
  _canonical_solutions_pass(sandbox, problems)


def test_wrong_solutions_fail(sandbox, problems):
  results = sandbox.run_many([build_test(p, "    return None\n") for p in problems.values()], workers=2)
  assert [r.status for r in results] == ["failed"] * len(problems)


# --- containment: what hostile code tries ------------------------------------------------------------

def test_environment_and_proc_of_the_evaluator_are_out_of_reach(sandbox, monkeypatch):
  secret = f"secret_{uuid.uuid4().hex}"
  monkeypatch.setenv("D2F_TEST_SECRET", secret)
  code = ("import os\nprint(dict(os.environ))\nprint(os.getuid(), os.getppid(), os.listdir('/'))\n"
          f"for path in ('/proc/{os.getpid()}/environ', '/proc/1/environ', '/proc/self/environ'):\n"
          "    try:\n        print(open(path, 'rb').read())\n    except OSError as e:\n"
          "        print(type(e).__name__)\n")
  result = sandbox.run(code)
  assert result.passed, result.stderr
  assert secret not in result.stdout and "D2F_TEST_SECRET" not in result.stdout
  lines = result.stdout.splitlines()
  assert lines[1].startswith("65534 ") and "'proc'" not in lines[1] and "'etc'" not in lines[1]
  assert lines[2:] == ["FileNotFoundError"] * 3


def test_checkout_and_system_files_cannot_be_read(sandbox):
  for path in (str(CHECKOUT_FILE), "/etc/passwd", os.path.expanduser("~/.bashrc"), "/work"):
    result = sandbox.run(f"print(open({path!r}).read())\n")
    assert result.status == "failed" and "FileNotFoundError" in result.reason, (path, result)


def test_writing_and_deleting_outside_changes_nothing(sandbox, host):
  attempts = [f"open({host['target']!r}, 'w').write('x')", f"import os; os.remove({host['keep']!r})",
              f"import shutil; shutil.rmtree({host['dir']!r})", "open('/escape', 'w').write('x')",
              f"open('/usr/{uuid.uuid4().hex}', 'w')", "import os; os.remove('/sandbox/launcher.py')"]
  for code in attempts:
    result = sandbox.run(code + "\n")
    assert result.status == "failed" and "Error" in result.reason, (code, result)
  inside = sandbox.run(f"open('/tmp/{Path(host['target']).name}', 'w').write('x')\n")  # its own tmpfs
  assert inside.passed
  assert host["unchanged"]()


def test_new_processes_cannot_act_on_the_host(sandbox, host):
  target = host["target"]
  code = ("import ctypes, os, subprocess\nresults = []\n"
          f"results.append(os.system('touch {target}'))\n"
          f"results.append(ctypes.CDLL(None).system(b'touch {target}'))\n"
          "try:\n"
          f"    results.append(subprocess.run(['/usr/bin/touch', {target!r}]).returncode)\n"
          "except OSError as e:\n    results.append(type(e).__name__)\n"
          "print(results)\n")
  result = sandbox.run(code)
  assert result.passed, result.stderr
  assert result.stdout.strip() == "[32512, 32512, 'FileNotFoundError']"  # no shell, no binaries
  assert host["unchanged"]()


@pytest.mark.parametrize("nested_user_namespace", [False, True])
def test_fork_bomb_is_bounded(sandbox, nested_user_namespace):
  """RLIMIT_NPROC binds because the sandbox user is no host root; a nested user namespace still counts."""
  unshare = "import ctypes\nassert ctypes.CDLL(None).unshare(0x10000000) == 0\n" if nested_user_namespace else ""
  code = (unshare + "import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
          "            time.sleep(600)\n            os._exit(0)\n        n += 1\n"
          "except OSError as e:\n    print(n, type(e).__name__, flush=True)\n")
  start = time.perf_counter()
  result = sandbox.run(code)
  assert result.passed, result.stderr
  forked, error = result.stdout.split()
  assert error == "BlockingIOError" and 0 < int(forked) < MAX_PROCESSES
  assert time.perf_counter() - start < 30.0  # its children (600 s asleep) died with the pid namespace
  assert subprocess.run(["true"]).returncode == 0  # and the host can still start processes


def _escape_code(marker: str) -> str:
  """Fork; the grandchild starts a new session, renames itself `marker` and outlives the run."""
  return ("import ctypes, os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
          f"        ctypes.CDLL(None).prctl(15, b'{marker}', 0, 0, 0)\n        time.sleep(20)\n"
          "        os._exit(0)\n    os._exit(0)\ntime.sleep(0.3)\nwhile True:\n    pass\n")


def _host_pids_named(marker: str) -> list[int]:
  pids = []
  for entry in os.listdir("/proc"):
    try:
      if entry.isdigit() and Path(f"/proc/{entry}/comm").read_text().strip() == marker:
        pids.append(int(entry))
    except OSError:
      pass
  return pids


@pytest.mark.parametrize("isolation", ["bubblewrap", "process"])
def test_fork_and_setsid_do_not_outlive_the_timeout(isolation):
  """The detector is shown to work on the fallback, where the escape succeeds (the issue's finding)."""
  if isolation == "bubblewrap" and REASON is not None:
    pytest.skip(f"bubblewrap cannot run here: {REASON}")
  marker = f"esc{uuid.uuid4().hex[:12]}"
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", ProcessIsolationWarning)
    box = Sandbox(isolation=isolation, timeout_s=1.5, guards=False) if isolation == "process" else \
        Sandbox(timeout_s=1.5)
  result = box.run(_escape_code(marker))
  assert result.status == "timeout"
  deadline = time.monotonic() + 3.0
  while time.monotonic() < deadline and _host_pids_named(marker):
    time.sleep(0.05)
  survivors = _host_pids_named(marker)
  for pid in survivors:
    os.kill(pid, 9)
  assert bool(survivors) == (isolation == "process")


def test_loopback_of_the_host_is_unreachable(sandbox):
  listener = socket.socket()
  listener.bind(("127.0.0.1", 0))
  listener.listen(8)
  listener.settimeout(0.5)
  port = listener.getsockname()[1]
  try:
    code = (f"import socket\ns = socket.socket()\ns.settimeout(2)\ns.connect(('127.0.0.1', {port}))\n"
            "s.sendall(b'hello')\n")
    result = sandbox.run(code)
    assert result.status == "failed" and "ConnectionRefusedError" in result.reason, result
    with pytest.raises(socket.timeout):
      listener.accept()  # no connection ever arrived
  finally:
    listener.close()


def test_memory_bomb_fails(sandbox):
  for code in ("block = bytearray(2 * 1024 ** 3)\n", "chunks = []\nwhile True:\n    chunks.append(b'x' * (1 << 24))\n"):
    result = sandbox.run(code)
    assert result.status == "failed" and "MemoryError" in result.reason


def test_infinite_loop_is_killed_by_the_timeout(sandbox):
  result = _bubblewrap_box(SHORT_TIMEOUT_S).run("while True:\n  pass\n")
  assert result.status == "timeout" and "timed out" in result.reason
  assert SHORT_TIMEOUT_S - 0.1 < result.seconds < SHORT_TIMEOUT_S + 10.0


def test_gigabytes_of_output_are_capped(sandbox):
  start = time.perf_counter()
  result = sandbox.run("import sys\nfor _ in range(4096):\n    sys.stdout.write('x' * (1 << 20))\n")
  assert result.status == "failed" and "File too large" in result.reason
  assert len(result.stdout) <= sandbox.output_chars and time.perf_counter() - start < 30.0  # not 4 GB written
  many = sandbox.run("for i in range(64):\n    open(f'/tmp/f{i}', 'wb').write(b'x' * (1 << 20))\n")
  assert many.status == "failed" and "No space left" in many.reason  # the 16 MB tmpfs is full


# --- choosing the isolation ----------------------------------------------------------------------------

def test_bubblewrap_unavailable_is_an_error_naming_the_fallback(monkeypatch):
  monkeypatch.setattr(bwrap, "probe", lambda python: "user namespaces are not permitted")
  with pytest.raises(BubblewrapUnavailable, match="not permitted.*isolation='process'"):
    Sandbox()


def test_process_fallback_is_explicit_warned_and_still_judges(problems):
  with pytest.warns(ProcessIsolationWarning, match="without namespaces"):
    box = Sandbox(isolation="process", timeout_s=4.0)
  assert box.describe()["isolation"] == "process"
  problem = problems[ADD_TASK]
  assert box.run_test(build_test(problem, problem["canonical_solution"])).passed
  assert box.run_test(build_test(problem, "    import os; os._exit(0)\n")).status == "failed"
  assert box.run(build_program(problem, problem["canonical_solution"])).passed


def test_describe_records_the_isolation(sandbox):
  described = sandbox.describe()
  assert described["isolation"] == "bubblewrap" and described["uid"] == 65534
  assert {"user", "pid", "mount", "network", "ipc"} <= set(described["namespaces"])


def test_bad_options_are_rejected():
  with pytest.raises(ValueError, match="isolation must be one of"):
    Sandbox(isolation="docker")
  with pytest.raises(ValueError, match="timeout_s"):
    Sandbox(timeout_s=0)
  with pytest.raises(ValueError, match="memory_mb must be a positive int, got -1"):
    Sandbox(memory_mb=-1)
  with pytest.raises(ValueError, match="file_mb"):
    Sandbox(file_mb=1.5)
  with pytest.raises(ValueError, match="not an executable"):
    Sandbox(python="/nonexistent/python")


def test_wire_encoding_is_exact_and_data_only():
  from d2f_jax.evals.sandbox.launcher import decode, encode
  values = [None, True, 0, -(10 ** 5000), 1.5, float("inf"), -0.0, 1 + 2j, "é\x00", b"\xff", [1, (2, 3)],
            {1: {"a": frozenset({4})}}, {5, 6}]
  for value in values:
    back = decode(encode(value))
    assert back == value and type(back) is type(value)
  assert repr(decode(encode(float("nan")))) == "nan"
  for bad in (object(), iter([]), lambda: 0, type("Eq", (int,), {})(1)):
    with pytest.raises(TypeError, match="cannot cross the sandbox boundary"):
      encode(bad)
  for bad in (["i"], ["q", 1], ["l", "x"], "s", ["d", [[["s", "k"]]]]):
    with pytest.raises(ValueError):
      decode(bad)


def test_a_test_program_can_be_built_by_hand(sandbox):
  test = TestProgram(candidate="def twice(x):\n    return 2 * x\n",
                     tests="def check(f):\n    assert f(3) == 6 and f([1]) == [1, 1]\n", entry_point="twice")
  assert sandbox.run_test(test).passed
