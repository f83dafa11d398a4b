"""A request's answer as it settles: the engine's events (on its thread) handed to the event loop, turned into
text pieces cut at max_tokens, the stop ids and the stop strings; closing the answer early cancels the request
in the engine."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import AsyncIterator

from d2f_jax.serve.protocol import Plan
from d2f_jax.serve.types import Event


@dataclasses.dataclass
class Piece:
  """A stretch of answer text; the last one has the finish reason and the final token counts."""

  text: str
  finish_reason: str | None
  prompt_tokens: int
  completion_tokens: int


class Inbox:
  """A request's events, handed from the engine thread to the event loop."""

  def __init__(self):
    self.loop = asyncio.get_running_loop()
    self.queue: asyncio.Queue[Event] = asyncio.Queue()

  def __call__(self, event: Event) -> None:  # on the engine thread: must never raise there
    try:
      self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
    except RuntimeError:  # the loop has closed (the server is exiting): nobody is listening
      pass


def _through_stop_string(model, ids: list[int], stop_strings: tuple[str, ...]) -> int:
  """How many of `ids` it takes for their text to hold a stop string (the answer's completion tokens: the same
  whenever the stop is noticed, alone or under load); len(ids) if none does."""
  low, high = 1, len(ids)
  while low < high:  # the shortest prefix whose text holds a stop (holding one only grows with the prefix)
    middle = (low + high) // 2
    text = model.decode(ids[:middle])
    low, high = (low, middle) if any(s in text for s in stop_strings) else (middle + 1, high)
  return high


def _cut(ids: list[int], p: Plan) -> tuple[list[int], str | None, int]:
  """(answer ids, finish reason if the ids already decide it, completion tokens) of the ids settled so far."""
  head = ids[:p.max_tokens]
  for i, token in enumerate(head):
    if token in p.stop_ids:
      return head[:i], "stop", i + 1
  return head, ("length" if len(ids) >= p.max_tokens else None), len(head)


async def answer(engine, model, request_id: str, inbox: Inbox, p: Plan) -> AsyncIterator[Piece]:
  """The request's text as it settles. Closing it before the last piece (a disconnect, a stop string)
  cancels the request in the engine."""
  ids: list[int] = []
  sent, engine_done = "", False
  hold = max((len(s) for s in p.stop_strings), default=1) - 1  # text that may yet become a stop string
  try:
    while True:
      event = await inbox.queue.get()
      engine_done = event.finished
      ids += event.ids
      answer_ids, reason, count = _cut(ids, p)
      text = model.decode(answer_ids) if answer_ids else ""
      hits = [i for i in (text.find(s) for s in p.stop_strings) if i >= 0]
      if hits:
        text, reason, count = text[:min(hits)], "stop", _through_stop_string(model, answer_ids, p.stop_strings)
      elif reason is None and engine_done:  # the engine's reason; 'cancelled' (shutdown) is vLLM's 'abort'
        reason = "abort" if event.finish_reason in ("cancelled", "error") else event.finish_reason
      if reason is None:  # keep back what may change: a partial character, a partial stop string
        text = text.rstrip("\ufffd")
        text = text[:len(text) - hold] if hold else text
      delta = text[len(sent):] if text.startswith(sent) else ""
      if delta or reason is not None:
        sent += delta
        yield Piece(delta, reason, event.prompt_tokens, count)
      if reason is not None:
        return
  finally:
    if not engine_done:
      engine.cancel(request_id)
