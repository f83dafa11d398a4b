"""Multi-process evaluation: two real JAX processes (jax.distributed on localhost CPU, gloo collectives) split
the batches and process 0 writes results.json / samples.jsonl equal to one process's run, timings aside."""

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from d2f_jax.evals.processes import Processes, assign_batches, merge_shares
from d2f_jax.models import TINY_LLADA

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GSM8K_FIXTURE = os.path.join(ROOT, "tests", "fixtures", "data", "gsm8k_test.jsonl")  # the project's own problems
FLAGS = ["--task", "gsm8k", "--data", GSM8K_FIXTURE, "--limit", "5", "--n_shot", "1", "--batch_size", "2", "--block_size", "4",
         "--max_new_tokens", "8", "--max_blocks_in_flight", "2", "--tau_conf", "0.02", "--attention", "xla"]


@pytest.mark.parametrize("count", [1, 2, 3, 7])
def test_assign_batches_covers_every_batch_once(count):
  shares = [assign_batches(10, i, count) for i in range(count)]
  assert sorted(b for share in shares for b in share) == list(range(10))
  assert all(share == sorted(share) for share in shares)
  assert max(map(len, shares)) - min(map(len, shares)) <= 1  # balanced


def _share(items, batches):
  return {"samples": [[i, {"id": i}] for i in items], "batch_seconds": [[b, 1.0] for b in batches],
          "warmup_batches": 1, "warmup_seconds": 2.0, "compiled_batches": 0}


def test_merge_restores_order_and_rejects_lost_or_doubled_shares():
  merged = merge_shares([_share([0, 1, 4], [0, 2]), _share([2, 3], [1])], total=5, num_batches=3)
  assert [s["id"] for s in merged["samples"]] == [0, 1, 2, 3, 4]
  assert merged["batch_seconds"] == [1.0, 1.0, 1.0] and merged["warmup_batches"] == 2
  with pytest.raises(ValueError, match="items \\[4\\]"):
    merge_shares([_share([0, 1], [0, 2]), _share([2, 3], [1])], total=5, num_batches=3)
  with pytest.raises(ValueError, match="item 1 came from two processes"):
    merge_shares([_share([0, 1, 4], [0, 2]), _share([1, 2, 3], [1])], total=5, num_batches=3)
  with pytest.raises(ValueError, match="index=2, count=2"):
    Processes(index=2, count=2)
  with pytest.raises(ValueError, match="outside"):
    assign_batches(3, 3, 2)


_CHILD = textwrap.dedent("""
    import json, sys
    import jax
    process, port, model, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=process,
                               initialization_timeout=120)
    jax.config.update("jax_default_matmul_precision", "highest")
    jax.config.update("jax_disable_most_optimizations", True)
    from d2f_jax import evaluate
    results = evaluate.main(["--model", model, "--out", out, "--distributed", "auto"] + json.loads(sys.argv[5]))
    print("RESULT" + json.dumps({"process": jax.process_index(), "count": jax.process_count(),
                                 "score": results["score"], "files": "files" in results}))
""")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  from d2f_jax.convert.synthetic import write_hf_checkpoint
  return write_hf_checkpoint(tmp_path_factory.mktemp("tiny_llada_multihost"), TINY_LLADA, seed=0, dtype="float32")


def _comparable(results: dict) -> dict:
  """results.json without what legitimately differs between runs: timings, machine, process count."""
  return {k: v for k, v in results.items() if k not in ("speed", "environment")}


def test_two_processes_write_what_one_process_writes(checkpoint, tmp_path):
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "3",
         "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
  env.pop("XLA_FLAGS", None)
  port = str(_free_port())
  outs = [tmp_path / "p0", tmp_path / "p1"]
  procs = [subprocess.Popen([sys.executable, "-c", _CHILD, str(i), port, checkpoint, str(outs[i]), json.dumps(FLAGS)],
                            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i in range(2)]
  reports = []
  for p in procs:
    stdout, stderr = p.communicate(timeout=600)
    assert p.returncode == 0, stderr[-4000:]
    reports.append(json.loads(next(x for x in stdout.splitlines() if x.startswith("RESULT"))[len("RESULT"):]))
  assert [(r["process"], r["count"], r["files"]) for r in reports] == [(0, 2, True), (1, 2, False)]
  assert reports[0]["score"] == reports[1]["score"]  # every process returns the merged results
  assert not outs[1].exists()  # only process 0 writes

  from d2f_jax import evaluate
  single = tmp_path / "single"
  evaluate.main(["--model", checkpoint, "--out", str(single), "--distributed", "off"] + FLAGS)
  read = lambda d: json.loads((d / "results.json").read_text())  # noqa: E731
  multi, one = read(outs[0]), read(single)
  assert multi["speed"]["processes"] == 2 and one["speed"]["processes"] == 1
  assert _comparable(multi) == _comparable(one)
  assert multi["speed"]["tokens"] == one["speed"]["tokens"] and multi["speed"]["forwards"] == one["speed"]["forwards"]

  def samples(d):
    rows = [json.loads(line) for line in (d / "samples.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k != "latency_s"} for row in rows]
  merged, alone = samples(outs[0]), samples(single)
  assert [s["id"] for s in merged] == [f"gsm8k/{i}" for i in range(5)]
  assert [s["batch"] for s in merged] == [0, 0, 1, 1, 2]  # batch 1 was decoded by process 1
  assert merged == alone
  assert any(s["tokens"] > 0 for s in merged)


_GENERATE_CHILD = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    process, port = int(sys.argv[1]), sys.argv[2]
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=process,
                               initialization_timeout=120)
    jax.config.update("jax_default_matmul_precision", "highest")
    jax.config.update("jax_disable_most_optimizations", True)
    from d2f_jax.api import Model
    from d2f_jax.decode import DecodeConfig, generate
    from d2f_jax.models import TINY_DREAM
    from d2f_jax.sharding import make_mesh
    from model_utils import random_model
    model = Model.from_module(random_model(TINY_DREAM, seed=3))
    config = DecodeConfig(block_size=4, max_new_tokens=16, max_blocks_in_flight=2, tau_conf=0.05, prompt_buckets=8)
    out = {}
    for name, sizes in (("tensor", dict(tensor=2)), ("data", dict(data=2))):  # one device per process
      result = generate(model.shard(make_mesh(sizes)), [[5, 6, 7], [8, 9, 10, 11, 12], [13]], config)
      out[name] = [np.asarray(result.tokens).tolist(), np.asarray(result.forwards).tolist()]
    print("RESULT" + json.dumps(out))
""")


def test_generate_on_a_mesh_spanning_two_processes():
  """Weights and rows split across two processes' devices: every process reads the same, one-device result."""
  import numpy as np

  from d2f_jax.api import Model
  from d2f_jax.decode import DecodeConfig, generate
  from d2f_jax.models import TINY_DREAM
  from model_utils import random_model

  env = {**os.environ, "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "3",
         "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH", "")])}
  env.pop("XLA_FLAGS", None)
  port = str(_free_port())
  procs = [subprocess.Popen([sys.executable, "-c", _GENERATE_CHILD, str(i), port], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
  reports = []
  for p in procs:
    stdout, stderr = p.communicate(timeout=600)
    assert p.returncode == 0, stderr[-4000:]
    reports.append(json.loads(next(x for x in stdout.splitlines() if x.startswith("RESULT"))[len("RESULT"):]))
  model = Model.from_module(random_model(TINY_DREAM, seed=3))
  config = DecodeConfig(block_size=4, max_new_tokens=16, max_blocks_in_flight=2, tau_conf=0.05, prompt_buckets=8)
  one = generate(model, [[5, 6, 7], [8, 9, 10, 11, 12], [13]], config)
  expected = [np.asarray(one.tokens).tolist(), np.asarray(one.forwards).tolist()]
  assert max(expected[1]) > min(expected[1])  # rows finish at different steps: the loop's stop rule matters
  for report in reports:
    assert report == {"tensor": expected, "data": expected}
