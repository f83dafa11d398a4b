"""`bench serve --soak MINUTES`: the real server under mixed, hostile traffic for a bounded time.

`python -m d2f_jax.serve` runs as a subprocess on a free localhost port over the main job's student; `--workers`
client threads send, until the time is up, a mix drawn from a seeded stream: plain and streamed completions,
streams dropped after their first chunk (a client gone), requests given up by a short client timeout
(cancellations), and bad bodies (malformed JSON, unknown fields, out-of-range values: each must be a 400).
Reported: requests by kind and outcome, errors by kind (anything but the expected status, or a stream that
does not end with [DONE]), the server's RSS at the start, after the first minute and at the end (growth after
the first minute is what a leak shows), and latency p50 / p99 of the completed requests. A clean soak has no
unexpected outcome and an RSS that settles.
"""

from __future__ import annotations

import collections
import json
import threading
import time

import numpy as np

BAD_BODIES = (b'{"prompt": [1, 2', b'{"prompt": "x", "presence_penalty": 1}', b'{"prompt": [1], "max_tokens": 0}',
              b'{"prompt": [1], "tau_conf": 7}', b'{"prompt": [1], "top_k": 2147483648}', b'[]')
KINDS = ("plain", "stream", "dropped", "cancelled", "bad")
WEIGHTS = (0.35, 0.35, 0.1, 0.1, 0.1)


def rss_mib(pid: int) -> float:
  """Resident memory of a process (Linux /proc), MiB."""
  with open(f"/proc/{pid}/status") as f:
    kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
  return kb / 1024.0


def _request(client, url: str, kind: str, prompt: list[int], record: dict) -> None:
  """One request of `kind`; `record` gets its outcome ('ok' or an unexpected one) and latency."""
  body = {"model": "student", "prompt": prompt}
  start = time.perf_counter()
  try:
    if kind == "bad":
      response = client.post(f"{url}/v1/completions", content=BAD_BODIES[len(prompt) % len(BAD_BODIES)],
                             headers={"Content-Type": "application/json"}, timeout=60)
      ok = response.status_code == 400 and response.json()["error"]["code"] == 400
      record["outcome"] = "ok" if ok else f"bad body got HTTP {response.status_code}"
    elif kind == "plain":
      response = client.post(f"{url}/v1/completions", json=body, timeout=300)
      ok = response.status_code == 200 and response.json()["choices"][0]["finish_reason"] in ("stop", "length")
      record["outcome"] = "ok" if ok else f"plain got HTTP {response.status_code}"
    elif kind == "cancelled":
      try:
        client.post(f"{url}/v1/completions", json=body, timeout=0.05)
        record["outcome"] = "ok"  # answered within the timeout: nothing to cancel
      except Exception:  # noqa: BLE001 - the client giving up is the point
        record["outcome"] = "ok"
    else:
      with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=300) as response:
        if response.status_code != 200:
          record["outcome"] = f"{kind} got HTTP {response.status_code}"
          return
        lines = response.iter_lines()
        if kind == "dropped":
          next(lines)
          record["outcome"] = "ok"
          return
        done = any(line == "data: [DONE]" for line in lines)
        record["outcome"] = "ok" if done else "stream without [DONE]"
  except Exception as e:  # noqa: BLE001 - every failure is counted by kind, never dropped
    record["outcome"] = f"{type(e).__name__}"
  record["latency"] = time.perf_counter() - start


def soak(url: str, pid: int, prompts: list[list[int]], minutes: float, workers: int = 8, seed: int = 0) -> dict:
  """Drive the server at `url` (process `pid`) for `minutes`; returns the report."""
  import httpx
  rng = np.random.default_rng(seed)
  plan = [(KINDS[k], int(p)) for k, p in zip(rng.choice(len(KINDS), 1 << 20, p=WEIGHTS),
                                              rng.integers(len(prompts), size=1 << 20))]
  records: list[dict] = []
  lock, cursor = threading.Lock(), [0]
  rss = {"start": rss_mib(pid)}
  start = time.monotonic()
  end = start + 60.0 * minutes

  def worker():
    with httpx.Client() as client:
      while time.monotonic() < end:
        with lock:
          kind, index = plan[cursor[0] % len(plan)]
          cursor[0] += 1
        record = {"kind": kind}
        _request(client, url, kind, prompts[index], record)
        with lock:
          records.append(record)

  threads = [threading.Thread(target=worker, daemon=True) for _ in range(workers)]
  for thread in threads:
    thread.start()
  while time.monotonic() < end:
    time.sleep(1.0)
    if "after 1 min" not in rss and time.monotonic() - start >= 60.0:
      rss["after 1 min"] = rss_mib(pid)
  for thread in threads:
    thread.join(360)
  rss["end"] = rss_mib(pid)
  base = rss.get("after 1 min", rss["start"])
  outcomes = collections.Counter((r["kind"], r.get("outcome", "no answer")) for r in records)
  unexpected = {f"{kind}: {outcome}": n for (kind, outcome), n in outcomes.items() if outcome != "ok"}
  done = [r["latency"] for r in records if r["kind"] in ("plain", "stream") and r.get("outcome") == "ok"]
  return {"minutes": minutes, "workers": workers, "requests": len(records),
          "by kind": dict(collections.Counter(r["kind"] for r in records)), "unexpected": unexpected,
          "rss MiB": {k: round(v, 1) for k, v in rss.items()},
          "rss growth after 1 min %": round(100.0 * (rss["end"] - base) / base, 2),
          "latency p50 s": round(float(np.percentile(done, 50)), 3) if done else None,
          "latency p99 s": round(float(np.percentile(done, 99)), 3) if done else None}


def summary_row(report: dict) -> dict:
  """The report as one table row."""
  rss = report["rss MiB"]
  return {"minutes": report["minutes"], "requests": report["requests"],
          "unexpected": sum(report["unexpected"].values()), "rss start MiB": rss["start"],
          "rss after 1 min MiB": rss.get("after 1 min"), "rss end MiB": rss["end"],
          "growth after 1 min %": report["rss growth after 1 min %"], "latency p50 s": report["latency p50 s"],
          "latency p99 s": report["latency p99 s"], "server exit": report["server exit"]}


def run(model_dir: str, prompts: list[list[int]], config, minutes: float, slots: int, log_path: str) -> dict:
  """The soak against one server process, stopped with SIGTERM afterwards (its exit status is reported)."""
  import subprocess
  from d2f_jax.bench.serve.load import start_server
  proc, url = start_server(model_dir, config, slots, max(map(len, prompts)), log_path)
  try:
    report = soak(url, proc.pid, prompts, minutes)
  finally:
    proc.terminate()
    try:
      report_exit = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
      proc.kill()
      report_exit = "killed after 120 s"
  report["server exit"] = report_exit
  print(json.dumps(report, indent=1))
  return report
