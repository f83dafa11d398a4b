"""`python -m d2f_jax.serve --model PATH_OR_HUB_ID`: load a model, warm the engine up, serve the OpenAI API.

Warm-up compiles every program the engine runs (Engine.warm_up) before the port opens, so the first real
request pays no compile and /health answers only once serving is fast. `--method ar` serves the causal
baseline model (one token per step) through the same engine and API; `--method llada2` a LLaDA2 model with its
released block sampler (`--editing_threshold`: LLaDA2.1's token editing; `--block_cache`: finished blocks cached).
SIGTERM (or Ctrl-C) drains: /health and new requests get 503 at once, queued and decoding requests finish
within --grace_s (the rest are cancelled, finish_reason 'abort'), their responses go out, and the process
exits 0. A second signal ends every request at once (finish_reason 'abort', streams closed with their last
chunk and [DONE]) and the process exits 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import threading

from d2f_jax.decode.flags import (add_device_flags, add_llada2_flags, add_mode_flags, check_model_flags,
                                  setup_devices)
from d2f_jax.serve.config import (AUTO_FROM_SLOTS, DEFAULT_MAX_BODY_BYTES, POLICIES, EngineConfig,
                                  auto_modes_from_frontier)
from d2f_jax.serve.types import ENGINE_METHODS
from d2f_jax.usage import ArgumentParser, UsageError, command

log = logging.getLogger("d2f_jax.serve")
API_KEY_ENV = "D2F_API_KEY"  # as vLLM's VLLM_API_KEY
_DEFAULTS = EngineConfig()  # every engine flag's default is the dataclass's, never retyped here


def build_parser() -> argparse.ArgumentParser:
  p = ArgumentParser("python -m d2f_jax.serve", __doc__)
  p.add_argument("--model", required=True, help="HF or converted model directory, or a Hub id (local cache)")
  p.add_argument("--lora_dir", "--lora", dest="lora_dir", default=None,
                 help="PEFT adapter directory merged into the model (a D2F student), as generate and evaluate take")
  p.add_argument("--method", default=_DEFAULTS.method, choices=tuple(ENGINE_METHODS),
                 help="d2f (requests may ask for d2f or threshold), ar (a causal baseline model) or llada2 (LLaDA2's "
                      "released block sampler)")
  p.add_argument("--dtype", default=None, help="compute / storage dtype, e.g. bfloat16; None keeps the checkpoint's")
  p.add_argument("--served_model_name", default=None, help="the name clients send as `model`; None: the --model value")
  p.add_argument("--host", default="127.0.0.1", help="address to listen on (localhost only by default)")
  p.add_argument("--port", type=int, default=8000, help="port to listen on")
  p.add_argument("--slots", type=int, default=_DEFAULTS.slots, help="requests decoded at once")
  p.add_argument("--block_size", type=int, default=_DEFAULTS.block_size, help="D2F block size, fixed per server")
  p.add_argument("--max_new_tokens", type=int, default=_DEFAULTS.max_new_tokens,
                 help="the most tokens a request may ask for")
  p.add_argument("--max_prompt_len", type=int, default=_DEFAULTS.max_prompt_len,
                 help="longer prompts are refused (400)")
  p.add_argument("--prompt_bucket", type=int, default=_DEFAULTS.prompt_bucket,
                 help="prefill widths are multiples of this")
  p.add_argument("--steps_per_call", type=int, default=_DEFAULTS.steps_per_call, help="D2F steps per device call")
  p.add_argument("--max_insert", type=int, default=_DEFAULTS.max_insert,
                 help="requests prefilled together in one call (one program per power of two up to this)")
  p.add_argument("--queue_size", type=int, default=_DEFAULTS.queue_size,
                 help="waiting requests beyond the slots (more: 429)")
  p.add_argument("--sampling", action="store_true", help="allow temperature > 0 (compiles the sampling path)")
  add_mode_flags(p)  # the engine's defaults are DecodeConfig's: off
  p.add_argument("--steps", type=int, default=_DEFAULTS.steps,
                 help="llada2: the released sampler's steps per block (default: one token a step at least)")
  add_llada2_flags(p)  # llada2: each request's default; requests may set their own
  p.add_argument("--policy", default=_DEFAULTS.policy, choices=POLICIES,
                 help="each request's mode, chosen at admission: latency (exact D2F), throughput (--query_limit), "
                      "auto (by live slots: --auto_modes or --frontier); default: throughput with --query_limit, "
                      "else latency")
  p.add_argument("--auto_modes", default=None,
                 help="auto: 'SLOTS:Q,...' from that many live slots on, query limit Q ('exact': none), e.g. "
                      f"'8:8,32:4'; default: exact below {AUTO_FROM_SLOTS} slots, --query_limit from there")
  p.add_argument("--frontier", default=None,
                 help="auto: the modes of a `bench cost --frontier --json` file (with --frontier_target, "
                      "--frontier_model when it holds several)")
  p.add_argument("--frontier_target", default=None, help="--frontier: the target's rows (h100, v5p-8, ...)")
  p.add_argument("--frontier_model", default=None, help="--frontier: the model's rows (llada-8b, dream-7b)")
  p.add_argument("--api_key", default=os.environ.get(API_KEY_ENV) or None,
                 help=f"require `Authorization: Bearer KEY` on every /v1 route (401 otherwise; /health stays open); "
                      f"default: ${API_KEY_ENV}, else none")
  p.add_argument("--grace_s", type=float, default=30.0,
                 help="on SIGTERM, how long in-flight requests may finish (a second signal ends them at once)")
  p.add_argument("--max_body_bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                 help="larger request bodies are refused (413) before they are read")
  p.add_argument("--log_level", default="info", choices=("debug", "info", "warning", "error"),
                 help="log verbosity")
  add_device_flags(p)
  return p


def _engine_config(args):
  modes = _auto_modes(args)
  try:
    return EngineConfig(slots=args.slots, method=args.method, block_size=args.block_size,
                        max_new_tokens=args.max_new_tokens,
                        max_prompt_len=args.max_prompt_len, prompt_bucket=min(args.prompt_bucket,
                                                                              max(args.max_prompt_len, 1)),
                        steps_per_call=args.steps_per_call, max_insert=args.max_insert, queue_size=args.queue_size,
                        sampling=args.sampling, query_limit=args.query_limit,
                        position_budget=args.position_budget, cache_decided=args.cache_decided, steps=args.steps,
                        editing_threshold=args.editing_threshold, max_post_steps=args.max_post_steps,
                        block_cache=args.block_cache, policy=args.policy or ("auto" if modes else None),
                        auto_modes=modes)
  except ValueError as e:
    raise UsageError(str(e).replace("EngineConfig.", "--")) from None


def _auto_modes(args) -> tuple[tuple[int, int | None], ...]:
  """--auto_modes or --frontier as EngineConfig.auto_modes; () when neither is given."""
  if args.auto_modes is not None and args.frontier is not None:
    raise UsageError("--auto_modes and --frontier both choose the auto policy's modes: pass one")
  if args.auto_modes is not None:
    try:
      pairs = [item.split(":") for item in args.auto_modes.split(",") if item.strip()]
      return tuple((int(slots), None if q.strip() == "exact" else int(q)) for slots, q in pairs)
    except ValueError:
      raise UsageError(f"--auto_modes must be 'SLOTS:Q,...' with Q an int or 'exact', got {args.auto_modes!r}"
                       ) from None
  if args.frontier is None:
    return ()
  import json
  try:
    with open(args.frontier) as f:
      rows = json.load(f)["frontier"]
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise UsageError(f"--frontier {args.frontier}: not a `bench cost --frontier --json` report ({e})") from None
  for key in ("target", "model"):
    wanted = getattr(args, f"frontier_{key}")
    found = sorted({str(r.get(key)) for r in rows})
    if wanted is None and len(found) > 1:
      raise UsageError(f"--frontier {args.frontier} holds rows of {key}s {found}: choose one with --frontier_{key}")
    rows = [r for r in rows if wanted is None or r.get(key) == wanted]
    if not rows:
      raise UsageError(f"--frontier {args.frontier} has no rows of {key} {wanted!r} (it has {found})")
  try:
    return auto_modes_from_frontier(rows, args.block_size, args.cache_decided)
  except ValueError as e:
    raise UsageError(f"--frontier {args.frontier}: {e}") from None


def _bind(host: str, port: int) -> socket.socket:
  sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  try:
    sock.bind((host, port))
  except OSError as e:
    sock.close()
    raise UsageError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})") from None
  sock.set_inheritable(True)
  return sock


@command
def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  handler = logging.StreamHandler()
  handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
  log.addHandler(handler)
  log.setLevel(args.log_level.upper())
  log.propagate = False
  config = _engine_config(args)
  if not 0 < args.port < 65536:
    raise UsageError(f"--port must lie in 1..65535, got {args.port}")
  if args.api_key == "":
    raise UsageError(f"--api_key (or ${API_KEY_ENV}) must not be empty")
  if args.grace_s < 0:
    raise UsageError(f"--grace_s must be >= 0, got {args.grace_s}")
  if args.max_body_bytes <= 0:
    raise UsageError(f"--max_body_bytes must be positive, got {args.max_body_bytes}")
  try:
    import uvicorn

    from d2f_jax.serve.server import create_app
  except ImportError as e:
    raise UsageError(f"serving needs FastAPI and uvicorn: pip install 'd2f_jax[serve]' ({e})") from None
  check_model_flags(args)  # a missing model directory or adapter fails before anything slow
  sock = _bind(args.host, args.port)  # before the slow part: a taken port fails at once
  mesh = setup_devices(args, local=True)
  import jax

  from d2f_jax.api import load_from_flags
  from d2f_jax.decode.limits import DecodeInputError
  from d2f_jax.serve import Engine
  if jax.process_count() > 1:
    raise UsageError("the server runs in one process; use --mesh over this process's devices")
  model = load_from_flags(args, mesh)
  try:
    engine = Engine(model, config)
  except (DecodeInputError, ValueError) as e:
    raise UsageError(f"the engine does not fit {args.model}: {e}") from None
  log.info("compiling the engine's programs (%d slots, prompt buckets of %d up to %d)...", config.slots,
           config.prompt_bucket, config.prompt_width)
  log.info("warm-up (compiles) took %.1f s", engine.warm_up())
  engine.start()
  name = args.served_model_name or args.model
  app = create_app(engine, model, name, api_key=args.api_key, max_body_bytes=args.max_body_bytes)
  if args.api_key is not None:
    log.info("every /v1 route wants the API key (Authorization: Bearer ...)")
  uvicorn_config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                  timeout_graceful_shutdown=int(args.grace_s) + 5)
  server = _make_draining_server()(uvicorn_config, app, engine, args.grace_s)
  log.info("serving %s on http://%s:%d/v1", name, args.host, args.port)
  # uvicorn restores these when it stops listening: a signal during the teardown after it (joining the engine)
  # must not kill a process that is already exiting cleanly.
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda number, _: log.info("signal %d: already exiting", number))
  server.run(sockets=[sock])
  return 0


def _make_draining_server():
  import uvicorn

  class DrainingServer(uvicorn.Server):
    """uvicorn's server whose first SIGTERM / SIGINT drains the engine before uvicorn's own shutdown (which
    then lets the open responses finish), and whose exit status stays 0 (uvicorn re-raises the signal)."""

    def __init__(self, config, app, engine, grace_s: float):
      super().__init__(config)
      self.app, self.engine, self.grace_s, self.draining = app, engine, grace_s, False

    def handle_exit(self, sig, frame) -> None:
      if self.draining:  # a second signal: every request ends now (finish_reason abort), responses close whole
        log.info("signal %d again: ending every request now (finish_reason abort)", sig)
        self.engine.abort()
        return
      self.draining = self.app.state.draining = True
      log.info("signal %d: draining (grace %.0f s)", sig, self.grace_s)
      threading.Thread(target=self._drain, name="d2f-drain", daemon=True).start()

    def _drain(self) -> None:
      self.engine.shutdown(self.grace_s)
      log.info("engine stopped; closing the server")
      self.should_exit = True

  return DrainingServer
