"""Atomic writes that several processes may race on: every writer gets its own temporary file, so readers
see one whole version or another, never a torn one, and no writer loses its temporary file to another."""

import json
import os
import threading

from d2f_jax import reporting


def test_concurrent_writers_of_one_results_file_never_tear_it(tmp_path):
  path = tmp_path / "results.json"
  reporting.write_json(path, {"writer": -1, "rows": []})
  errors, bad_reads = [], []
  stop = threading.Event()

  def writer(k):
    try:
      for i in range(150):
        reporting.write_json(path, {"writer": k, "i": i, "rows": list(range(2000))})
        reporting.write_jsonl(tmp_path / "samples.jsonl", [{"writer": k, "i": i}] * 50)
    except Exception as e:  # noqa: BLE001 - what the test looks for
      errors.append(repr(e))

  def reader():
    while not stop.is_set():
      try:
        json.loads(path.read_text())
      except json.JSONDecodeError as e:
        bad_reads.append(str(e))

  threads = [threading.Thread(target=writer, args=(k,)) for k in range(3)]
  watcher = threading.Thread(target=reader)
  watcher.start()
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  stop.set()
  watcher.join()
  assert not errors and not bad_reads, (errors[:3], bad_reads[:3])
  assert sorted(os.listdir(tmp_path)) == ["results.json", "samples.jsonl"]  # no temporary left behind
  assert oct(os.stat(path).st_mode & 0o777) == oct(0o666 & ~_umask())  # as plain open() would make it


def _umask() -> int:
  mask = os.umask(0)
  os.umask(mask)
  return mask


def test_evaluate_default_output_dirs_of_two_runs_started_together_differ(monkeypatch):
  from d2f_jax import evaluate
  first, second = evaluate.default_out_dir("gsm8k", "d2f"), evaluate.default_out_dir("gsm8k", "d2f")
  assert first != second and first.startswith("results/evals/gsm8k_d2f_")
