"""The OpenAI-compatible HTTP server over an Engine: POST /v1/completions, POST /v1/chat/completions (both with
`stream: true` as server-sent events in OpenAI's chunk format), GET /v1/models, GET /health.

The engine calls back on its own thread; each request gets an asyncio.Queue that the callbacks fill through
loop.call_soon_threadsafe, so the event loop never blocks on the device. A request whose client goes away
(a cancelled streaming task, or a disconnect seen while a plain request waits) is cancelled in the engine,
which frees its slot at the next round; so is one whose answer ended early here (max_tokens below the
block-rounded budget, a stop string). Status codes: 400 bad body (the error names the field), 404 another
model's name, 429 queue full, 503 shutting down.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from d2f_jax.serve.answers import Piece, Inbox, answer
from d2f_jax.serve.config import DEFAULT_MAX_BODY_BYTES
from d2f_jax.serve.guards import BodyLimit, check_prompt_chars, longest_token_chars
from d2f_jax.serve.protocol import (ENGINE_FIELDS, BadRequest, ChatMessage, ChatRequest, CompletionRequest,
                                    error_body, plan)
from d2f_jax.serve.types import EngineStopped, QueueFull, RequestError

log = logging.getLogger("d2f_jax.serve")

_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict"}  # pydantic's union branches in an error's loc


def _error(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
  return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def chat_prompt_ids(model, messages: list[ChatMessage]) -> list[int]:
  """The prompt ids of a conversation: the tokenizer's chat template, or without one the plain lines
  'role: content' followed by 'assistant:'."""
  if model.tokenizer is None:
    raise BadRequest("messages", "this model has no tokenizer; send token ids to /v1/completions")
  turns = [{"role": m.role, "content": m.text()} for m in messages]
  if getattr(model.tokenizer, "chat_template", None):
    try:
      return list(model.tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True,
                                                      return_dict=False))
    except Exception as e:  # a template may refuse a conversation (e.g. roles out of order)
      raise BadRequest("messages", f"the model's chat template refused these messages: {e}") from None
  return model.encode("".join(f"{t['role']}: {t['content']}\n" for t in turns) + "assistant:")


async def _until_disconnected(request: Request) -> None:
  while (await request.receive())["type"] != "http.disconnect":
    pass


async def _collect(pieces: AsyncIterator[Piece], request: Request) -> tuple[str, Piece] | None:
  """All the text of a plain (non-streaming) answer and its last piece; None if the client went away first."""
  texts: list[str] = []

  async def consume() -> Piece:
    async for piece in pieces:
      texts.append(piece.text)
    return piece

  task, watch = asyncio.ensure_future(consume()), asyncio.ensure_future(_until_disconnected(request))
  try:
    await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
  finally:
    watch.cancel()
    if not task.done():
      task.cancel()  # a CancelledError inside `answer`: it cancels the engine request
  return ("".join(texts), task.result()) if task.done() and not task.cancelled() else None


def _usage(piece: Piece) -> dict:
  return {"prompt_tokens": piece.prompt_tokens, "completion_tokens": piece.completion_tokens,
          "total_tokens": piece.prompt_tokens + piece.completion_tokens}


def _sse(data: dict) -> str:
  return f"data: {json.dumps(data)}\n\n"


def create_app(engine, model, served_model_name: str, api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
  """The app over a started engine. `app.state.draining = True` makes /health answer 503 (the CLI sets it on
  SIGTERM, as it shuts the engine down; the engine then refuses new requests: 503). With `api_key`, every /v1
  route wants `Authorization: Bearer <api_key>` (401 otherwise, as vLLM's --api-key); /health stays open.
  Bodies over `max_body_bytes` get 413 (serve/guards.py); prompts are tokenized off the event loop."""
  app = FastAPI(title="d2f_jax", docs_url=None, redoc_url=None, openapi_url=None)
  app.state.draining = False
  if api_key is not None:
    expected = f"Bearer {api_key}".encode()

    @app.middleware("http")
    async def authorize(request: Request, call_next):
      given = request.headers.get("authorization", "").encode()
      if request.url.path.startswith("/v1") and not secrets.compare_digest(given, expected):
        return _error(401, "this server wants an API key: send the header `Authorization: Bearer <key>`"
                      if not given else "the API key is not this server's")
      return await call_next(request)
  app.add_middleware(BodyLimit, limit=max_body_bytes)
  cfg = engine.config
  token_chars = longest_token_chars(model.tokenizer) if model.tokenizer is not None else None
  model_stop_ids = tuple(dict.fromkeys(t for t in (model.config.eos_token_id, model.config.eot_token_id)
                                       if t is not None))

  @app.exception_handler(RequestValidationError)
  async def invalid(_, exc: RequestValidationError):
    errors = exc.errors()
    if errors[0]["type"] == "json_invalid":
      return _error(400, f"the body is not valid JSON: {errors[0].get('ctx', {}).get('error', errors[0]['msg'])}")
    field = errors[0]["loc"][1] if len(errors[0]["loc"]) > 1 else None
    said = []  # every failure of the first field (a union fails once per branch)
    for e in errors:
      if len(e["loc"]) > 1 and e["loc"][1] == field:
        loc = [x for x in e["loc"][1:] if not (isinstance(x, str) and (x in _TYPE_TAGS or "[" in x))]
        said.append(f"{'.'.join(map(str, loc))}: " + ("unknown or unsupported field" if e["type"] == "extra_forbidden"
                                                     else f"{e['msg']}, got {str(e.get('input'))[:60]!r}"))
    return _error(400, " or ".join(dict.fromkeys(said)) or str(errors[0]["msg"]), None if field is None else str(field))

  @app.exception_handler(HTTPException)
  async def http_error(_, exc: HTTPException):  # 404, 405 (with its Allow header), 413 of a chunked body
    return _error(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

  @app.exception_handler(Exception)
  async def internal_error(request: Request, exc: Exception):
    """The last resort: whatever a request holds, a JSON 500 with an id to find its traceback in the log."""
    error_id = uuid.uuid4().hex[:12]
    log.error("error %s on %s %s", error_id, request.method, request.url.path, exc_info=exc)
    return _error(500, f"internal error {error_id}: {type(exc).__name__} (the server's log has the traceback)")

  @app.get("/health")
  async def health():
    load = engine.load()
    status = "failed" if load["error"] else "draining" if app.state.draining else "ok"
    body = {"status": status, "slots": load["slots"], "free_slots": load["free_slots"], "queued": load["queued"]}
    if load["error"]:
      body["error"] = load["error"]
    return JSONResponse(body, status_code=200 if status == "ok" else 503)

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": 0,
                                        "owned_by": "d2f_jax", "max_model_len": cfg.max_prompt_len +
                                        cfg.max_new_tokens}]}

  @app.post("/v1/completions")
  async def completions(body: CompletionRequest, request: Request):
    if not body.prompt:
      return _error(400, "prompt: must not be empty", "prompt")
    if isinstance(body.prompt, str) and model.tokenizer is None:
      return _error(400, "prompt: this model has no tokenizer; send a list of token ids", "prompt")

    def encode() -> list[int]:
      if not isinstance(body.prompt, str):
        return body.prompt
      try:
        return model.encode(body.prompt)
      except (TypeError, ValueError, UnicodeError) as e:  # e.g. a lone surrogate: the tokenizer's TypeError
        raise BadRequest("prompt", f"cannot be tokenized ({type(e).__name__}: {str(e)[:120]})") from None
    chars = len(body.prompt) if isinstance(body.prompt, str) else 0
    return await _respond(body, request, encode, chars, "prompt", "cmpl")

  @app.post("/v1/chat/completions")
  async def chat(body: ChatRequest, request: Request):
    chars = sum(len(m.text()) for m in body.messages)
    return await _respond(body, request, lambda: chat_prompt_ids(model, body.messages), chars, "messages",
                          "chatcmpl")

  async def _respond(body, request: Request, prompt_ids, chars: int, prompt_field: str, kind: str):
    if body.model is not None and body.model != served_model_name:
      return _error(404, f"the model {body.model!r} does not exist; this server serves {served_model_name!r}",
                    "model")
    too_long = check_prompt_chars(chars, cfg.max_prompt_len, token_chars)
    if too_long:
      return _error(400, f"{prompt_field}: {too_long}", prompt_field)
    try:
      p = plan(body, block_size=cfg.block_size, bound=cfg.max_new_tokens, model_stop_ids=model_stop_ids,
               vocab_size=model.config.vocab_size)
      ids = await asyncio.get_running_loop().run_in_executor(None, prompt_ids)  # the event loop stays free
      inbox = Inbox()
      request_id = engine.submit(ids, p.settings, inbox, request_id=f"{kind}-{uuid.uuid4().hex}")
    except BadRequest as e:
      return _error(400, f"{e.param}: {e.message}", e.param)
    except RequestError as e:
      field = prompt_field if e.field == "prompt" else ENGINE_FIELDS.get(e.field, e.field)
      return _error(400, f"{field}: {e.message}", field)
    except QueueFull as e:
      return _error(429, f"the server is busy: {e}", headers={"Retry-After": "1"})
    except EngineStopped as e:
      return _error(503, str(e))
    pieces = answer(engine, model, request_id, inbox, p)
    head = {"id": request_id, "created": int(time.time()), "model": served_model_name}
    if body.stream:
      usage = body.stream_options is not None and body.stream_options.include_usage
      return StreamingResponse(_stream(pieces, head, kind, usage), media_type="text/event-stream")
    got = await _collect(pieces, request)
    if got is None:
      return _error(499, "the client disconnected")
    text, last = got
    if kind == "cmpl":
      choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": last.finish_reason}
    else:
      choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": last.finish_reason}
    return {**head, "object": "text_completion" if kind == "cmpl" else "chat.completion", "choices": [choice],
            "usage": _usage(last)}

  return app


async def _stream(pieces: AsyncIterator[Piece], head: dict, kind: str, include_usage: bool) -> AsyncIterator[str]:
  """OpenAI's chunks: (chat: a first chunk with the role) text deltas, the finish reason on the last choice
  chunk, a usage chunk with no choices when asked for, then `data: [DONE]`."""
  obj = "text_completion" if kind == "cmpl" else "chat.completion.chunk"
  extra = {"usage": None} if include_usage else {}

  def chunk(delta: str | dict, reason: str | None) -> str:
    choice = ({"index": 0, "text": delta} if kind == "cmpl" else {"index": 0, "delta": delta})
    return _sse({**head, "object": obj, "choices": [{**choice, "logprobs": None, "finish_reason": reason}],
                 **extra})
  if kind == "chatcmpl":
    yield chunk({"role": "assistant", "content": ""}, None)
  async for piece in pieces:
    text = piece.text if kind == "cmpl" else ({"content": piece.text} if piece.text else {})
    yield chunk(text, piece.finish_reason)
    last = piece
  if include_usage:
    yield _sse({**head, "object": obj, "choices": [], "usage": _usage(last)})
  yield "data: [DONE]\n\n"
