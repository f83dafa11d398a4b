"""The OpenAI-compatible server, run for real: `python -m d2f_jax.serve` on a free localhost port over a tiny
synthetic Dream checkpoint, driven by the official `openai` client. Greedy answers equal `Model.generate`'s
(batch 1 per row), streamed or not, alone or with concurrent clients; bad bodies get 400s naming the field;
a disconnected client's request is cancelled; a 10 MB body is refused while /health answers; SIGTERM drains,
a second signal aborts the rest, and the process exits 0.

One server serves the whole file (its warm-up compiles dominate); the SIGTERM test stops it and runs last.
No test depends on timing beyond generous bounded waits.
"""

import asyncio
import json
import concurrent.futures
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import types

import httpx
import openai
import pytest
from safetensors.numpy import load_file, save_file

import d2f_jax
from d2f_jax.convert import synthetic
from d2f_jax.models import TINY_DREAM
from d2f_jax.serve import EngineStopped, Event, QueueFull
from d2f_jax.serve.protocol import Plan
from d2f_jax.serve.answers import Inbox, answer

SETTINGS = dict(block_size=4, max_new_tokens=16)
PROMPTS = ["w5 w7 w9", "w11 w13", "w100 w200 w300 w400 w17", "w42", "w8 w9 w10 w11 w12 w13 w14 w15 w16 w17 w18",
           "w301 w302", "w77 w66 w55 w44"]
CHATS = ["w5 w7", "w19 w23 w29"]
STARTUP_S = 300


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _checkpoint(directory: pathlib.Path) -> pathlib.Path:
  """The tiny Dream with a 4x head, so greedy choices are clear (no near-ties that padding could flip)."""
  synthetic.write_hf_checkpoint(directory, TINY_DREAM, seed=0, dtype="float32")
  weights = load_file(directory / "model.safetensors")
  weights["lm_head.weight"] = weights["lm_head.weight"] * 4.0
  save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
  return directory


API_KEY = "test-key"  # the server is started with it (--api_key)
AUTH = {"Authorization": f"Bearer {API_KEY}"}

class Server:
  def __init__(self, checkpoint: pathlib.Path, log: pathlib.Path, extra_args: tuple[str, ...] = ()):
    self.port, self.log = _free_port(), log
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_DEFAULT_MATMUL_PRECISION": "highest",
           "JAX_DISABLE_MOST_OPTIMIZATIONS": "true"}  # the test process's settings (conftest.py)
    with open(log, "w") as out:
      self.proc = subprocess.Popen(
          [sys.executable, "-m", "d2f_jax.serve", "--model", str(checkpoint), "--port", str(self.port),
           "--slots", "4", "--block_size", "4", "--max_new_tokens", "16", "--max_prompt_len", "32",
           "--served_model_name", "tiny", "--grace_s", "60", "--api_key", API_KEY, *extra_args],
          stdout=out, stderr=subprocess.STDOUT, env=env)
    self.url = f"http://127.0.0.1:{self.port}"
    self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)

  def wait_ready(self) -> None:
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
      assert self.proc.poll() is None, f"the server exited ({self.proc.returncode}):\n{self.log.read_text()}"
      try:
        if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
          return
      except httpx.TransportError:
        pass
      time.sleep(0.5)
    raise AssertionError(f"no /health within {STARTUP_S} s:\n{self.log.read_text()}")

  def health(self) -> dict:
    return httpx.get(f"{self.url}/health", timeout=30).json()

  def stop(self) -> None:
    if self.proc.poll() is None:
      self.proc.kill()
      self.proc.wait()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  """(server, {prompt: greedy text}, {chat message: greedy text}); the expected texts are decoded here while
  the server warms up."""
  root = tmp_path_factory.mktemp("serve")
  checkpoint = _checkpoint(root / "tiny")
  server = Server(checkpoint, root / "server.log")
  try:
    model = d2f_jax.load_model(checkpoint)
    texts = dict(zip(PROMPTS, model.generate(PROMPTS, prompt_buckets=32, **SETTINGS)))
    chats = dict(zip(CHATS, model.generate(CHATS, chat=True, prompt_buckets=32, **SETTINGS)))
    assert all(texts.values()) and all(chats.values()), (texts, chats)  # answers to compare, not empty ones
    server.wait_ready()
    yield server, texts, chats
  finally:
    server.stop()


def test_models_and_health(served):
  server, _, _ = served
  assert [m.id for m in server.client.models.list().data] == ["tiny"]
  assert server.health() == {"status": "ok", "slots": 4, "free_slots": 4, "queued": 0}


def test_completions_and_chat_equal_batch_one_generate(served):
  server, texts, chats = served
  for prompt in PROMPTS[:2]:
    got = server.client.completions.create(model="tiny", prompt=prompt, max_tokens=16)
    assert got.choices[0].text == texts[prompt]
    assert got.choices[0].finish_reason in ("stop", "length")
    assert got.usage.prompt_tokens == len(prompt.split())
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens
  by_ids = server.client.completions.create(model="tiny", prompt=[5, 7, 9])  # token ids; max_tokens: the bound
  assert by_ids.choices[0].text == texts["w5 w7 w9"]
  for content in CHATS:
    got = server.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}])
    assert got.choices[0].message.content == chats[content] and got.choices[0].message.role == "assistant"
    assert got.usage.completion_tokens > 0


def test_streams_concatenate_to_the_plain_answer_with_usage_last(served):
  server, texts, chats = served
  prompt = PROMPTS[2]
  chunks = list(server.client.completions.create(model="tiny", prompt=prompt, stream=True,
                                                 stream_options={"include_usage": True}))
  assert "".join(c.choices[0].text for c in chunks if c.choices) == texts[prompt]
  assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == len(prompt.split())
  assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
  chunks = list(server.client.chat.completions.create(model="tiny", stream=True,
                                                      messages=[{"role": "user", "content": CHATS[1]}]))
  assert chunks[0].choices[0].delta.role == "assistant"
  assert "".join(c.choices[0].delta.content or "" for c in chunks) == chats[CHATS[1]]
  assert all(c.usage is None for c in chunks)  # usage only when asked for


def test_max_tokens_stop_strings_and_stop_ids_cut_the_answer(served):
  server, texts, _ = served
  got = server.client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=6)  # decoded as 8
  assert got.usage.completion_tokens <= 6 and texts[PROMPTS[3]].startswith(got.choices[0].text)
  if got.usage.completion_tokens == 6:
    assert got.choices[0].finish_reason == "length" and len(got.choices[0].text.split()) == 6
  words = texts[PROMPTS[3]].split()
  assert len(words) >= 3, texts[PROMPTS[3]]
  got = server.client.completions.create(model="tiny", prompt=PROMPTS[3], stop=[words[2]]).choices[0]
  assert got.text == texts[PROMPTS[3]][:texts[PROMPTS[3]].find(words[2])] and got.finish_reason == "stop"
  got = server.client.completions.create(model="tiny", prompt=PROMPTS[3],
                                         extra_body={"stop_token_ids": [int(words[2][1:])]}).choices[0]
  assert got.text == " ".join(words[:words.index(words[2])]) and got.finish_reason == "stop"


BAD = [  # (endpoint, body, the field the 400 names)
    ("completions", {"prompt": "w5", "presence_penalty": 0.5}, "presence_penalty"),
    ("completions", {"prompt": "w5", "tau_conf": 1.5}, "tau_conf"),
    ("completions", {"prompt": "w5", "tau_add": "high"}, "tau_add"),
    ("completions", {"prompt": " ".join(["w3"] * 33)}, "prompt"),
    ("completions", {"prompt": [1, 2, 10 ** 6]}, "prompt"),
    ("completions", {"prompt": "w5", "max_tokens": 17}, "max_tokens"),
    ("completions", {"prompt": "w5", "n": 2}, "n"),
    ("completions", {"prompt": "w5", "echo": True}, "echo"),
    ("completions", {"prompt": "w5", "temperature": 0.7}, "temperature"),
    ("completions", {"prompt": "w5", "top_k": -2}, "top_k"),
    ("completions", {"prompt": "w5", "method": "vanilla"}, "method"),
    ("completions", {"prompt": "w5", "stop_token_ids": [512]}, "stop_token_ids"),
    ("chat", {"messages": [{"role": "user", "content": " ".join(["w3"] * 40)}]}, "messages"),
    ("chat", {"messages": [{"role": "robot", "content": "w1"}]}, "messages"),
]


def test_bad_requests_get_400_naming_the_field(served):
  server, _, _ = served
  for endpoint, body, field in BAD:
    create = server.client.completions.create if endpoint == "completions" else server.client.chat.completions.create
    known = {k: v for k, v in body.items() if k in ("prompt", "messages", "max_tokens", "n", "echo", "temperature",
                                                    "presence_penalty")}
    with pytest.raises(openai.BadRequestError) as error:
      create(model="tiny", **known, extra_body={k: v for k, v in body.items() if k not in known})
    assert error.value.status_code == 400
    got = error.value.body  # the client unwraps {"error": {...}}
    assert got["param"] == field and got["code"] == 400 and got["type"] == "BadRequestError", (body, got)
    assert field in got["message"], (body, got)
  assert server.health()["free_slots"] == 4
  with pytest.raises(openai.NotFoundError):
    server.client.completions.create(model="another", prompt="w5")


def test_concurrent_clients_each_get_their_batch_one_answer(served):
  server, texts, _ = served
  prompts = PROMPTS[1:]  # six clients over four slots: some wait in the queue
  with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
    futures = {p: pool.submit(server.client.completions.create, model="tiny", prompt=p) for p in prompts}
    for prompt, future in futures.items():
      assert future.result(timeout=300).choices[0].text == texts[prompt], prompt


def _wait_all_slots_free(server, bound_s=120):
  deadline = time.monotonic() + bound_s
  while time.monotonic() < deadline:
    health = server.health()
    if health["free_slots"] == health["slots"] and health["queued"] == 0:
      return
    time.sleep(0.2)
  raise AssertionError(f"slots still busy after {bound_s} s: {server.health()}")


def test_a_client_that_disconnects_mid_stream_frees_its_slot(served):
  server, texts, _ = served
  for _ in range(4):  # as many as there are slots: a slot kept by a gone client would starve the last request
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=120, headers=AUTH,
                      json={"model": "tiny", "prompt": PROMPTS[4], "stream": True}) as response:
      assert response.status_code == 200
      next(response.iter_lines())  # the first chunk, then the client goes away
  _wait_all_slots_free(server)
  assert server.client.completions.create(model="tiny", prompt=PROMPTS[0]).choices[0].text == texts[PROMPTS[0]]


def test_the_api_key_guards_every_v1_route_and_not_health(served):
  """The fixture's server runs with --api_key (every other test sends it through the openai client)."""
  server = served[0]
  for headers, message in (({}, "wants an API key"), ({"Authorization": "Bearer wrong"}, "not this server's")):
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions")):
      response = httpx.request(method, server.url + path, headers=headers, json={"prompt": "w1"}, timeout=30)
      assert response.status_code == 401, (path, response.text)
      error = response.json()["error"]
      assert error["type"] == "AuthenticationError" and error["code"] == 401 and message in error["message"]
  assert httpx.get(f"{server.url}/v1/models", headers=AUTH, timeout=30).status_code == 200
  assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200  # no key: load balancers probe it
  with pytest.raises(openai.AuthenticationError):
    openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()


def test_a_prompt_that_cannot_be_tokenized_or_an_overflowing_field_is_a_400_naming_it(served):
  """A lone surrogate reaches the tokenizer as a str it refuses; top_k 2**31 would overflow an int32 knob."""
  server = served[0]
  for body, param in (({"prompt": "w5 \ud800 w7"}, "prompt"), ({"prompt": "w5", "top_k": 2147483648}, "top_k"),
                      ({"prompt": "w5", "stop_token_ids": [2 ** 40]}, "stop_token_ids")):
    response = httpx.post(f"{server.url}/v1/completions", headers={**AUTH, "Content-Type": "application/json"},
                          content=json.dumps({"model": "tiny", **body}), timeout=60)  # \ud800 escaped
    assert response.status_code == 400, (body, response.text)
    assert response.json()["error"]["param"] == param, response.text


def test_an_unexpected_failure_is_a_json_500_with_an_id():
  from d2f_jax.serve.server import create_app
  model = types.SimpleNamespace(config=TINY_DREAM, tokenizer=None)
  app = create_app(_FakeEngine(RuntimeError("boom")), model, "tiny")

  async def post():
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
      return await client.post("/v1/completions", json={"prompt": [1, 2]})
  response = asyncio.run(post())
  error = response.json()["error"]
  assert response.status_code == 500 and error["code"] == 500 and error["message"].startswith("internal error ")
  assert "RuntimeError" in error["message"] and "boom" not in error["message"]


class _FakeEngine:
  """No device: records cancellations; `refuse` is what submit raises."""

  def __init__(self, refuse=None):
    self.cancelled, self.refuse, self.slots, self.queue = [], refuse, [None], []
    self.config = types.SimpleNamespace(slots=1, block_size=4, max_new_tokens=16, max_prompt_len=32)

  def submit(self, *args, **kwargs):
    raise self.refuse

  def cancel(self, request_id):
    self.cancelled.append(request_id)


def test_a_full_queue_is_429_and_a_stopping_engine_503():
  from d2f_jax.serve.server import create_app
  model = types.SimpleNamespace(config=TINY_DREAM, tokenizer=None)
  for refuse, status in ((QueueFull("9 waiting"), 429), (EngineStopped("shutting down"), 503)):
    app = create_app(_FakeEngine(refuse), model, "tiny")

    async def post():
      async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        return await client.post("/v1/completions", json={"prompt": [1, 2]})
    response = asyncio.run(post())
    assert response.status_code == status and response.json()["error"]["code"] == status


class _Words:
  def decode(self, ids):
    return " ".join(f"w{i}" for i in ids)


def test_an_answer_closed_early_cancels_its_request_and_a_finished_one_does_not():
  """The disconnect path without timing: `answer` cancels the engine request when it is closed before the
  engine's last event (a gone client, a stop string, max_tokens below the block-rounded budget)."""
  plan = Plan(settings=None, max_tokens=6, stop_ids=frozenset({501}), stop_strings=("w9",))

  def event(ids, finished=False, reason=None):
    return Event("r", ids, finished, reason, 3, 0, 0)

  async def run(events, take):
    engine, inbox = _FakeEngine(), Inbox()
    for e in events:
      inbox.queue.put_nowait(e)
    pieces = answer(engine, _Words(), "r", inbox, plan)
    got = [await anext(pieces) for _ in range(take)]
    await pieces.aclose()
    return got, engine.cancelled

  got, cancelled = asyncio.run(run([event([1, 2, 3, 4])], 1))  # a client gone after the first piece
  # (the last character is held back: it could begin the stop string "w9")
  assert got[0].text == "w1 w2 w3 w" and got[0].finish_reason is None and cancelled == ["r"]
  got, cancelled = asyncio.run(run([event([1, 2, 3, 4]), event([5, 6, 7, 8])], 2))  # max_tokens 6 of 8
  assert got[0].text + got[1].text == "w1 w2 w3 w4 w5 w6" and got[1].finish_reason == "length" and got[1].completion_tokens == 6
  assert cancelled == ["r"]
  got, cancelled = asyncio.run(run([event([1, 2, 9, 4])], 1))  # a stop string
  assert got[0].text == "w1 w2 " and got[0].finish_reason == "stop" and cancelled == ["r"]
  got, cancelled = asyncio.run(run([event([1, 501], finished=True, reason="stop")], 1))  # the engine's own end
  assert got[0].text == "w1" and got[0].finish_reason == "stop" and got[0].completion_tokens == 2
  assert cancelled == []


def test_a_10_mb_body_is_refused_at_once_and_health_answers_meanwhile(served):
  server = served[0]
  body = json.dumps({"model": "tiny", "prompt": "w5 " * ((10 << 20) // 3)}).encode()
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    big = pool.submit(httpx.post, f"{server.url}/v1/completions", content=body, timeout=120,
                      headers={**AUTH, "Content-Type": "application/json"})
    assert server.health()["status"] == "ok"
    response = big.result(timeout=120)
  assert response.status_code == 413 and response.json()["error"]["code"] == 413, response.text


def _stream_text(server, prompt) -> tuple[str, str | None, bool]:
  """(text, last finish_reason, ended with [DONE]) of one streamed completion read to its end."""
  text, reason, done = "", None, False
  with httpx.stream("POST", f"{server.url}/v1/completions", timeout=120, headers=AUTH,
                    json={"model": "tiny", "prompt": prompt, "stream": True}) as response:
    if response.status_code != 200:
      return "", f"http {response.status_code}", True
    for line in response.iter_lines():
      if line == "data: [DONE]":
        done = True
      elif line.startswith("data: "):
        choice = json.loads(line[6:])["choices"][0]
        text, reason = text + choice["text"], choice["finish_reason"] or reason
  return text, reason, done


def test_sigterm_drains_a_second_signal_aborts_the_rest_and_the_process_exits_zero(served):
  """Last: it stops the shared server. Requests admitted before the first signal finish or (after the second,
  sent at once) end with finish_reason 'abort'; every stream closes with its last chunk and [DONE]."""
  server, texts, _ = served
  prompts = (PROMPTS * 4)[:24]  # six times the slots: most are still queued when the signals come
  with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
    futures = [pool.submit(_stream_text, server, p) if i % 2 else
               pool.submit(server.client.completions.create, model="tiny", prompt=p) for i, p in enumerate(prompts)]
    time.sleep(0.5)  # let them be admitted (a bound, not a race: whatever state each is in, the checks hold)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=120) == 0, server.log.read_text()
    for i, (prompt, future) in enumerate(zip(prompts, futures)):
      try:
        got = future.result(timeout=60)
      except (openai.APIConnectionError, openai.InternalServerError, httpx.TransportError):
        continue  # sent after the listener closed (refused) or while draining (503): never admitted
      text, reason, done = got if i % 2 else (got.choices[0].text, got.choices[0].finish_reason, True)
      if reason == "http 503":
        continue
      assert done and (reason == "abort" and texts[prompt].startswith(text) or text == texts[prompt]), (prompt, got)
  log = server.log.read_text()
  # The second signal either found requests to end (abort) or the server already exiting (all were done):
  # which one depends on how fast the tiny model answered; both must end in exit 0 with every response whole.
  assert "draining" in log and ("again: ending every request" in log or "already exiting" in log), log
  assert "Traceback" not in log and "terminate called" not in log, log
