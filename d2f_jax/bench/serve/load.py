"""Open-loop load test of the real server: `python -m d2f_jax.serve` as a subprocess on a free localhost port,
requests arriving as a Poisson process at each offered rate (seeded), each a streamed completion over HTTP.

Open loop: a request is sent at its arrival time whether or not earlier ones have finished, as users arrive;
a closed loop (next request after the last answer) would hide queueing. Bounded: `count` requests per rate,
each with a timeout, localhost only. Reports completed requests, errors (must be 0), completion tokens/s over
the phase, time to first token and latency p50 / p99.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np

REQUEST_TIMEOUT_S = 120.0


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def start_server(model_dir: str, config, slots: int, max_prompt_len: int, log_path: str) -> tuple[subprocess.Popen,
                                                                                                   str]:
  """The server on a free port, ready (its warm-up done): (process, base URL)."""
  import httpx
  port = _free_port()
  args = [sys.executable, "-m", "d2f_jax.serve", "--model", model_dir, "--port", str(port), "--slots", str(slots),
          "--block_size", str(config.block_size), "--max_new_tokens", str(config.max_new_tokens),
          "--max_prompt_len", str(max_prompt_len), "--prompt_bucket", str(config.prompt_buckets),
          "--log_level", "warning", "--served_model_name", "student"]
  log = open(log_path, "w")
  proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
  url = f"http://127.0.0.1:{port}"
  deadline = time.monotonic() + 600
  while time.monotonic() < deadline:
    if proc.poll() is not None:
      raise RuntimeError(f"the server exited with {proc.returncode} before it was ready; see {log_path}")
    try:
      if httpx.get(f"{url}/health", timeout=2).status_code == 200:
        return proc, url
    except httpx.HTTPError:
      pass
    time.sleep(0.5)
  proc.kill()
  raise RuntimeError(f"the server was not ready within 600 s; see {log_path}")


def _one(client, url: str, body: dict, record: dict) -> None:
  """One streamed completion: time to the first text, to the end, and the usage the last chunk reports."""
  start = time.perf_counter()
  try:
    with client.stream("POST", f"{url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S) as response:
      if response.status_code != 200:
        record["error"] = f"HTTP {response.status_code}"
        return
      for line in response.iter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
          continue
        chunk = json.loads(line[6:])
        if chunk.get("choices") and chunk["choices"][0].get("text") and "ttft" not in record:
          record["ttft"] = time.perf_counter() - start
        if chunk.get("usage"):
          record["tokens"] = chunk["usage"]["completion_tokens"]
    record["latency"] = time.perf_counter() - start
  except Exception as e:  # noqa: BLE001 - counted as an error of the run, never silently dropped
    record["error"] = f"{type(e).__name__}: {e}"


def offered_load(url: str, prompts: list[list[int]], config, rate: float, count: int, seed: int) -> dict:
  """`count` requests at Poisson arrivals of `rate` per second; waits for all (bounded by their timeouts)."""
  import httpx
  gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=count)
  body = dict(model="student", max_tokens=config.max_new_tokens, stream=True, stream_options={"include_usage": True},
              tau_add=config.tau_add, tau_act=config.tau_act, tau_conf=config.tau_conf)
  records = [{} for _ in range(count)]
  threads = []
  with httpx.Client(limits=httpx.Limits(max_connections=count)) as client:
    start = time.perf_counter()
    for i, at in enumerate(np.cumsum(gaps)):
      time.sleep(max(0.0, start + at - time.perf_counter()))
      thread = threading.Thread(target=_one, args=(client, url, {**body, "prompt": prompts[i % len(prompts)]},
                                                   records[i]), daemon=True)
      thread.start()
      threads.append(thread)
    for thread in threads:
      thread.join(REQUEST_TIMEOUT_S + 5)
    seconds = time.perf_counter() - start
  ok = [r for r in records if "latency" in r and "error" not in r]
  errors = [r.get("error", "no answer") for r in records if r not in ok]
  pct = lambda key, q: round(float(np.percentile([r[key] for r in ok if key in r], q)), 3) if ok else None  # noqa: E731
  return {"offered req/s": rate, "requests": count, "completed": len(ok), "errors": len(errors),
          "tokens/s": round(sum(r.get("tokens", 0) for r in ok) / seconds, 1),
          "ttft p50 s": pct("ttft", 50), "ttft p99 s": pct("ttft", 99),
          "latency p50 s": pct("latency", 50), "latency p99 s": pct("latency", 99),
          "first errors": errors[:3]}


def run(model_dir: str, prompts: list[list[int]], config, *, slots: int = 32, rates=(4.0, 16.0, 64.0),
        count: int = 128, log_path: str = os.path.join("results", "bench_serve_server.log")) -> list[dict]:
  """The load test at each rate against one server process (stopped with SIGTERM afterwards)."""
  os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
  proc, url = start_server(model_dir, config, slots, max(map(len, prompts)), log_path)
  try:
    rows = [offered_load(url, prompts, config, rate, count, seed=i) for i, rate in enumerate(rates)]
  finally:
    proc.terminate()
    try:
      proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
      proc.kill()
  return rows
