"""What the HTTP server refuses before it spends time on a request: a body over `--max_body_bytes` (413, before
it is read when Content-Length says so, else as soon as the bytes read pass the limit), and a text prompt whose
characters alone could not fit `--max_prompt_len` tokens (400 before tokenizing: a 10 MB prompt must not hold
a tokenizer thread for seconds to be refused anyway)."""

from __future__ import annotations

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from d2f_jax.serve.protocol import error_body


class BodyLimit:
  """ASGI middleware: request bodies of at most `limit` bytes."""

  def __init__(self, app, limit: int):
    self.app, self.limit = app, limit

  def _message(self, size: str) -> str:
    return f"the request body is {size} bytes, over this server's limit of {self.limit} (--max_body_bytes)"

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    declared = dict(scope.get("headers") or ()).get(b"content-length", b"")
    if declared.isdigit() and int(declared) > self.limit:
      response = JSONResponse(error_body(413, self._message(declared.decode())), status_code=413,
                              headers={"Connection": "close"})
      return await response(scope, receive, send)
    seen = 0

    async def bounded():
      nonlocal seen
      message = await receive()
      if message["type"] == "http.request":
        seen += len(message.get("body", b""))
        if seen > self.limit:  # the route's body read raises: its HTTPException handler answers 413
          raise HTTPException(413, self._message(f"more than {self.limit}"))
      return message
    return await self.app(scope, bounded, send)


def longest_token_chars(tokenizer) -> int | None:
  """The most characters one token of `tokenizer` can stand for (its longest vocabulary entry: a byte-level
  entry's characters are its bytes, at least the characters it decodes to); None when it does not say."""
  vocab = getattr(tokenizer, "get_vocab", None)
  try:
    entries = vocab() if vocab is not None else None
  except Exception:  # noqa: BLE001 - a tokenizer without a readable vocabulary: no bound
    return None
  return max((len(entry) for entry in entries), default=None) if entries else None


def check_prompt_chars(text_chars: int, max_prompt_len: int, token_chars: int | None) -> str | None:
  """Why a prompt of `text_chars` characters cannot fit `max_prompt_len` tokens whatever it says, or None."""
  if token_chars is None or text_chars <= max_prompt_len * token_chars:
    return None
  return (f"has {text_chars} characters; at most {token_chars} per token that is more than this server's "
          f"max_prompt_len of {max_prompt_len} tokens")
