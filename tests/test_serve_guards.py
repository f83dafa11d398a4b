"""The server's edges that need no device (the app over a fake engine, in process): 405 with Allow, 413 for a
body over the limit (declared or streamed), an empty prompt, a prompt whose characters cannot fit, stop ids
counted apart from the model's own, 429 with Retry-After; usage.completion_tokens of an answer cut by a stop
string is the same however its tokens arrived. The real server's cases are in tests/test_serve_server.py."""

import asyncio
import types

import httpx
import pytest

from d2f_jax.models import TINY_DREAM
from d2f_jax.serve import Event, QueueFull
from d2f_jax.serve.answers import Inbox, answer
from d2f_jax.serve.guards import check_prompt_chars, longest_token_chars
from d2f_jax.serve.protocol import BadRequest, CompletionRequest, Plan, plan
from d2f_jax.serve.server import create_app
from test_serve_server import _FakeEngine, _Words


class _Tokenizer:
  """Words 'w<id>'; the longest vocabulary entry has 4 characters."""
  chat_template = None

  def get_vocab(self):
    return {"w1": 1, "w22": 2, "w333": 3}


def _request(app, method, path, **kw):
  async def go():
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
      return await client.request(method, path, **kw)
  return asyncio.run(go())


def _app(tokenizer=None, **kw):
  model = types.SimpleNamespace(config=TINY_DREAM, tokenizer=tokenizer, encode=lambda text: [1, 2],
                                decode=lambda ids: " ".join(f"w{i}" for i in ids))
  engine = _FakeEngine(QueueFull("9 waiting"))  # every route's checks run before submit refuses
  engine.config.max_prompt_len = 8
  return create_app(engine, model, "tiny", **kw)


def test_405_names_the_allowed_methods_and_413_refuses_a_body_over_the_limit():
  app = _app(max_body_bytes=64)
  response = _request(app, "GET", "/v1/completions")
  assert response.status_code == 405 and response.headers["allow"] == "POST"
  assert response.json()["error"]["type"] == "MethodNotAllowedError"
  big = b'{"prompt": "' + b"w1 " * 40 + b'"}'
  response = _request(app, "POST", "/v1/completions", content=big, headers={"Content-Type": "application/json"})
  assert response.status_code == 413 and "limit of 64" in response.json()["error"]["message"]
  assert response.json()["error"]["type"] == "RequestTooLargeError"

  async def chunks():  # no Content-Length: refused as the bytes read pass the limit
    for _ in range(8):
      yield b" " * 16
  response = _request(app, "POST", "/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
  assert response.status_code == 413 and "more than 64" in response.json()["error"]["message"]
  response = _request(app, "POST", "/v1/completions", json={"prompt": [1]})  # small: reaches the engine
  assert response.status_code == 429 and response.headers["retry-after"] == "1"


def test_an_empty_prompt_and_a_prompt_too_long_in_characters_are_400s_naming_it():
  app = _app(_Tokenizer())
  for prompt, says in (("", "must not be empty"), ([], "must not be empty"),
                       ("w1 " * 11, "33 characters; at most 4 per token")):  # 33 > 8 tokens x 4 characters
    response = _request(app, "POST", "/v1/completions", json={"prompt": prompt})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "prompt" and says in error["message"], error
  response = _request(app, "POST", "/v1/chat/completions", json={"messages": [{"role": "user", "content": "w1" * 17}]})
  assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
  assert _request(app, "POST", "/v1/completions", json={"prompt": "w1 " * 10}).status_code == 429  # 30: may fit
  assert longest_token_chars(_Tokenizer()) == 4 and longest_token_chars(object()) is None
  assert check_prompt_chars(10 ** 7, 8, None) is None  # no vocabulary: no bound, the engine's count decides


def test_stop_token_ids_are_counted_apart_from_the_models_own():
  def planned(ids):
    body = CompletionRequest(prompt="w1", stop_token_ids=ids)
    return plan(body, block_size=4, bound=16, model_stop_ids=(5, 6), vocab_size=100)
  assert planned([7, 5, 7]).stop_ids == frozenset({5, 6, 7})  # repeats and the model's own ids are free
  assert len(planned(list(range(10, 16))).settings.stop_ids) == 8
  with pytest.raises(BadRequest, match=r"at most 6 ids besides the model's own stop ids \[5, 6\].*got 7"):
    planned(list(range(10, 17)))
  with pytest.raises(BadRequest, match=r"in \[0, 100\), got \[100, -1\]") as error:
    planned([7, 100, -1])
  assert error.value.param == "stop_token_ids"


def test_completion_tokens_of_a_stop_string_answer_do_not_depend_on_when_it_was_noticed():
  """The stop string 'w9' comes with the 3rd token: 3 completion tokens, whether the engine settled 3, 4 or 8
  tokens by the time it was seen (load decides that)."""
  plan_ = Plan(settings=None, max_tokens=16, stop_ids=frozenset({501}), stop_strings=("w9",))

  async def run(chunks):
    engine, inbox = _FakeEngine(), Inbox()
    for i, ids in enumerate(chunks):
      inbox.queue.put_nowait(Event("r", ids, i == len(chunks) - 1, None, 3, 0, 0))
    return [piece async for piece in answer(engine, _Words(), "r", inbox, plan_)]
  for chunks in ([[1, 2, 9]], [[1, 2, 9, 4]], [[1], [2, 9, 4, 5, 6, 7, 8]], [[1, 2, 9, 4, 5, 6, 7, 8]]):
    pieces = asyncio.run(run(chunks))
    assert "".join(p.text for p in pieces) == "w1 w2 " and pieces[-1].finish_reason == "stop"
    assert pieces[-1].completion_tokens == 3, chunks
