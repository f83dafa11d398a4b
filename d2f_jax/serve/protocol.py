"""The OpenAI-compatible request bodies (the subset of vLLM's server this engine can honour) and what a body
becomes for the engine.

Unknown fields are refused (extra='forbid') rather than ignored, so a client never believes a setting it sent
(logprobs, presence_penalty, best_of, ...) took effect; types are strict ("0.5" is not a number, true is not 1).
Semantics that differ from OpenAI's, all stated in docs/serving.md:
- greedy by default (temperature 0), the setting every D2F result in this project uses;
- `max_tokens` may be any count up to the engine's bound: the engine decodes whole blocks, so it is rounded up
  to the block size and the answer is cut at `max_tokens` tokens (finish_reason 'length');
- `stop_token_ids` add to the model's eos / end-of-turn ids; a stop id ends the answer and is not in its text;
- `n` must be 1, `echo` false; `seed` makes a sampled answer reproducible: the request draws as
  `generate(..., key=jax.random.key(seed))` alone, whatever shares the engine.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from d2f_jax.decode.config import MAX_STOP_IDS
from d2f_jax.serve.types import RequestSettings

_DEFAULTS = RequestSettings()


class _Body(BaseModel):
  model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
  include_usage: StrictBool = False


class TextPart(_Body):
  type: Literal["text"]
  text: StrictStr


class ChatMessage(_Body):
  role: Literal["system", "user", "assistant"]
  content: StrictStr | list[TextPart]
  name: StrictStr | None = None

  def text(self) -> str:
    return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class _Request(_Body):
  model: StrictStr | None = None  # when given, must be the served model's name
  max_tokens: StrictInt | None = Field(None, ge=1)
  temperature: StrictFloat = 0.0
  top_p: StrictFloat = 1.0
  top_k: StrictInt = Field(0, ge=-1)  # vLLM's extra: -1 or 0 = off
  stop: StrictStr | list[StrictStr] | None = None
  stop_token_ids: list[StrictInt] | None = None
  stream: StrictBool = False
  stream_options: StreamOptions | None = None
  n: StrictInt = 1
  seed: StrictInt | None = None
  user: StrictStr | None = None  # accepted and ignored, as OpenAI's servers log it
  # D2F: the paper's thresholds and decoder by default (block size is fixed per engine).
  tau_add: StrictFloat = _DEFAULTS.tau_add
  tau_act: StrictFloat = _DEFAULTS.tau_act
  tau_conf: StrictFloat = _DEFAULTS.tau_conf
  method: StrictStr = _DEFAULTS.method
  # LLaDA2.1's token editing, on a llada2 server started with --editing_threshold (None: the server's).
  editing_threshold: StrictFloat | None = _DEFAULTS.editing_threshold
  max_post_steps: StrictInt | None = _DEFAULTS.max_post_steps

  def requested_tokens(self) -> tuple[str, int | None]:
    return "max_tokens", self.max_tokens


class CompletionRequest(_Request):
  prompt: StrictStr | list[StrictInt]
  echo: StrictBool = False


class ChatRequest(_Request):
  messages: list[ChatMessage] = Field(min_length=1)
  max_completion_tokens: StrictInt | None = Field(None, ge=1)  # newer clients' name for max_tokens

  def requested_tokens(self) -> tuple[str, int | None]:
    if self.max_completion_tokens is not None:
      return "max_completion_tokens", self.max_completion_tokens
    return "max_tokens", self.max_tokens


class BadRequest(ValueError):
  """A body that parses but asks for what this server cannot do; `param` names the field."""

  def __init__(self, param: str, message: str):
    super().__init__(message)
    self.param, self.message = param, message


@dataclasses.dataclass(frozen=True)
class Plan:
  """What the engine runs for a body and how its answer is cut."""

  settings: RequestSettings
  max_tokens: int  # the answer is cut here (the engine decodes max_tokens rounded up to a block)
  stop_ids: frozenset  # ids that end the answer (not shown in its text)
  stop_strings: tuple[str, ...]


def plan(body: _Request, *, block_size: int, bound: int, model_stop_ids: tuple[int, ...], vocab_size: int) -> Plan:
  """The engine's RequestSettings and the cut for a parsed body; BadRequest names what cannot be honoured."""
  if body.n != 1:
    raise BadRequest("n", f"only n=1 is supported (one answer per request), got {body.n}")
  if getattr(body, "echo", False):
    raise BadRequest("echo", "echo=true is not supported")
  if body.stream_options is not None and not body.stream:
    raise BadRequest("stream_options", "is only allowed with stream=true")
  if isinstance(getattr(body, "max_completion_tokens", None), int) and body.max_tokens is not None:
    raise BadRequest("max_tokens", "give max_tokens or max_completion_tokens, not both")
  field, wanted = body.requested_tokens()
  max_tokens = bound if wanted is None else wanted
  if max_tokens > bound:
    raise BadRequest(field, f"must be at most this server's max_new_tokens {bound}, got {max_tokens}")
  stop_strings = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
  if any(not s for s in stop_strings):
    raise BadRequest("stop", "stop strings must be non-empty")
  given = list(body.stop_token_ids or ())
  outside = [t for t in given if not 0 <= t < vocab_size]
  if outside:
    raise BadRequest("stop_token_ids", f"must be token ids in [0, {vocab_size}), got {outside}")
  extra_ids = tuple(dict.fromkeys(t for t in given if t not in model_stop_ids))
  room = MAX_STOP_IDS - len(model_stop_ids)
  if len(extra_ids) > room:
    raise BadRequest("stop_token_ids", f"at most {room} ids besides the model's own stop ids {list(model_stop_ids)} "
                                       f"(always on), got {len(extra_ids)}: {list(extra_ids)}")
  settings = RequestSettings(
      method=body.method, max_new_tokens=-(-max_tokens // block_size) * block_size, tau_add=body.tau_add,
      tau_act=body.tau_act, tau_conf=body.tau_conf, temperature=body.temperature, top_p=body.top_p,
      top_k=max(body.top_k, 0), seed=body.seed, editing_threshold=body.editing_threshold,
      max_post_steps=body.max_post_steps, stop_ids=model_stop_ids + extra_ids if extra_ids else None)
  return Plan(settings=settings, max_tokens=max_tokens, stop_ids=frozenset(model_stop_ids + extra_ids),
              stop_strings=tuple(stop_strings))


# The engine's names for fields (RequestError.field) -> the names a client sent.
ENGINE_FIELDS = {"max_new_tokens": "max_tokens", "stop_ids": "stop_token_ids"}


def error_body(status: int, message: str, param: str | None = None) -> dict:
  """OpenAI's error object (vLLM's `type` names)."""
  kind = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowedError",
          413: "RequestTooLargeError", 429: "RateLimitError", 503: "ServiceUnavailableError"}.get(
              status, "InternalServerError")
  return {"error": {"message": message, "type": kind, "param": param, "code": status}}
