"""Serving: the continuous-batching D2F engine (fixed slots, no recompiles, batch-invariant greedy outputs)
and its OpenAI-compatible server (`python -m d2f_jax.serve`)."""

from d2f_jax.serve.config import EngineConfig
from d2f_jax.serve.engine import Engine
from d2f_jax.serve.types import (Completion, EngineStopped, Event, QueueFull, RequestError, RequestSettings)

__all__ = ["Completion", "Engine", "EngineConfig", "EngineStopped", "Event", "QueueFull", "RequestError",
           "RequestSettings"]
