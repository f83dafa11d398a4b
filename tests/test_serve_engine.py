"""The serving engine is batch-invariant: every request's tokens, forwards and acceptance steps (greedy, fp32)
equal `decode.generate` on that request alone, whatever shares the engine and whenever it arrived.

Sharpened random tiny models (test_decode.sharp_model) of both layouts; ragged prompts and answer lengths,
arrivals while other slots decode, a cancellation, d2f and threshold requests side by side.
"""

import dataclasses

import numpy as np
import pytest

from d2f_jax.decode import DecodeConfig, generate, resolve
from d2f_jax.models import TINY_LLADA
from d2f_jax.serve import Engine, EngineConfig, RequestError, RequestSettings
from test_decode import sharp_model

# Prompts of 3..19 tokens: buckets 8, 16 and 24 of an engine whose prompt width is 24.
PROMPTS = [[11, 23, 5], [3, 14, 15, 92, 65, 35, 89, 79, 32], [2, 71, 82, 81, 82, 84, 59, 4, 52, 35, 36, 2],
           [7, 7, 8, 9, 10, 44, 45, 46, 47, 48, 49, 50, 51, 60, 61, 62, 63, 64, 65], [99, 98]]
ENGINE = EngineConfig(slots=3, block_size=4, max_new_tokens=16, max_prompt_len=20, prompt_bucket=8, steps_per_call=3)
# (method, max_new_tokens, tau_add, tau_act, tau_conf) per request: the paper's thresholds, looser ones that keep
# several blocks in flight, shorter answers, and the threshold decoder.
SETTINGS = [RequestSettings(), RequestSettings(tau_add=0.25, tau_act=0.5, tau_conf=0.5),
            RequestSettings(max_new_tokens=8, tau_add=0.0, tau_act=0.75, tau_conf=0.3),
            RequestSettings(method="threshold", tau_conf=0.5), RequestSettings(max_new_tokens=12, tau_conf=0.6)]


_ALONE = {}


def _alone(model, prompt, settings: RequestSettings, query_limit: int | None = None):
  key = (model.config.family, tuple(prompt), settings, query_limit)
  if key not in _ALONE:
    _ALONE[key] = _decode_alone(model, prompt, settings, query_limit)
  return _ALONE[key]


def _decode_alone(model, prompt, settings: RequestSettings, query_limit: int | None = None):
  config = DecodeConfig(method=settings.method or "d2f", block_size=ENGINE.block_size,
                        max_new_tokens=settings.max_new_tokens or ENGINE.max_new_tokens, tau_add=settings.tau_add,
                        tau_act=settings.tau_act, tau_conf=settings.tau_conf, prompt_buckets=8,
                        query_limit=query_limit)
  result = generate(model, [prompt], config)
  n = int(result.lengths[0])
  return dict(tokens=np.asarray(result.tokens[0, :n]).tolist(), forwards=int(result.forwards[0]),
              trace=np.asarray(result.trace[0]).tolist(), max_in_flight=int(result.max_in_flight[0]),
              window_sum=int(result.window_sum[0]))


def _check(completion, want, where):
  assert completion.tokens == want["tokens"], where
  assert completion.forwards == want["forwards"], where
  assert completion.trace == want["trace"], where
  assert completion.stats["max_in_flight"] == want["max_in_flight"], where


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_requests_decode_as_alone_whatever_shares_the_engine(family):
  model = sharp_model(family)
  engine = Engine(model, ENGINE)
  events: dict[str, list] = {}

  def record(event):
    events.setdefault(event.request_id, []).append(event)

  # Two requests first; the others arrive while those decode (more requests than slots, so some wait).
  ids = [engine.submit(PROMPTS[i], SETTINGS[i], record) for i in range(2)]
  engine.round()
  ids += [engine.submit(PROMPTS[i], SETTINGS[i], record) for i in range(2, 5)]
  cancelled = engine.submit(PROMPTS[0], SETTINGS[1], record)
  engine.round()
  engine.cancel(cancelled)
  engine.run_until_idle()
  assert not engine.busy
  for i, request_id in enumerate(ids):
    stream = events[request_id]
    final = stream[-1]
    assert final.finished and [e.finished for e in stream].count(True) == 1
    _check(final.completion, _alone(model, PROMPTS[i], SETTINGS[i]), f"{family} request {i}")
    # Streamed ids, concatenated, are the final tokens; the usage counts match.
    assert sum((e.ids for e in stream), []) == final.completion.tokens
    assert final.completion_tokens == len(final.completion.tokens) and final.prompt_tokens == len(PROMPTS[i])
    assert final.finish_reason == ("stop" if final.completion.tokens[-1] in (model.config.eos_token_id,
                                                                              model.config.eot_token_id) else "length")
  assert events[cancelled][-1].finish_reason == "cancelled"


def test_a_full_engine_equals_alone_and_refills_every_slot():
  """Eight requests through two slots with `complete`: every slot is refilled several times."""
  model = sharp_model("dream")
  engine = Engine(model, EngineConfig(**{**ENGINE.__dict__, "slots": 2}))
  prompts = PROMPTS + PROMPTS[:3]
  settings = SETTINGS + SETTINGS[1:4]
  finished = []
  results = engine.complete(prompts, settings, progress=finished.append)
  assert len(finished) == len(prompts)
  for i, (prompt, s, got) in enumerate(zip(prompts, settings, results)):
    _check(got, _alone(model, prompt, s), f"request {i}")


def test_a_query_limited_engine_decodes_every_request_as_generate_in_that_mode():
  """The throughput mode (EngineConfig.query_limit) keeps batch invariance: each request equals `generate`
  alone with the same query_limit, whatever shares the slots."""
  model = sharp_model("dream")
  engine = Engine(model, EngineConfig(**{**ENGINE.__dict__, "slots": 2, "query_limit": 2}))
  settings = SETTINGS[:4]
  results = engine.complete(PROMPTS[:4], settings)
  for i, (prompt, s, got) in enumerate(zip(PROMPTS, settings, results)):
    assert got.query_limit == 2, i
    _check(got, _alone(model, prompt, s, query_limit=2), f"request {i}")
    assert 0 < got.stats["position_sum"] <= got.forwards * 16, i  # at most the widest window a forward
  with pytest.raises(ValueError, match="query_limit must be None or a positive int on a 'd2f' engine"):
    EngineConfig(method="ar", query_limit=2)


def test_the_auto_policy_picks_each_requests_mode_by_load_without_recompiling():
  """policy 'auto': a request admitted with 1 live slot decodes exactly, with 2 at q=2, with 3 at q=1; each keeps
  its mode to the end and equals `generate` alone in it; after warm-up no program is traced again."""
  from d2f_jax.serve import programs
  jitted = (programs.insert_rows, programs.advance_slots, programs.release_slots, programs.read_slots)
  model = sharp_model("llada")
  engine = Engine(model, EngineConfig(**{**ENGINE.__dict__, "slots": 3, "policy": "auto",
                                         "auto_modes": ((1, None), (2, 2), (3, 1))}))
  engine.warm_up()
  compiled = [f._cache_size() for f in jitted]
  done = {}

  def record(event):
    if event.finished:
      done[event.request_id] = event.completion
  order = [(0, SETTINGS[0]), (1, SETTINGS[1]), (2, SETTINGS[4]), (3, SETTINGS[3]), (4, SETTINGS[2])]
  ids = [engine.submit(PROMPTS[0], SETTINGS[0], record)]
  engine.round()  # admitted alone: exact
  ids += [engine.submit(PROMPTS[i], s, record) for i, s in order[1:3]]
  engine.round()  # two more admitted with 3 live: q=1
  engine.run_until_idle()
  ids += [engine.submit(PROMPTS[i], s, record) for i, s in order[3:]]
  engine.run_until_idle()  # two admitted together into an idle engine: q=2
  modes = [done[request_id].query_limit for request_id in ids]
  assert modes == [None, 1, 1, 2, 2]
  for request_id, (i, s) in zip(ids, order):
    _check(done[request_id], _alone(model, PROMPTS[i], s, query_limit=done[request_id].query_limit), request_id)
  assert [f._cache_size() for f in jitted] == compiled


def test_policies_are_checked_and_resolved():
  from d2f_jax.serve.config import auto_modes_from_frontier
  assert EngineConfig().modes == ((1, None),) and EngineConfig(query_limit=4).mode_policy == "throughput"
  auto = EngineConfig(policy="auto", query_limit=4)
  assert auto.modes == ((1, None), (8, 4)) and auto.decode_config().query_limit == 4
  assert [auto.query_limit_at(n) for n in (1, 7, 8, 32)] == [None, None, 4, 4]
  table = EngineConfig(policy="auto", auto_modes=((8, 8), (32, 4)))
  assert [table.query_limit_at(n) for n in (1, 8, 31, 32)] == [None, 8, 8, 4] and table.decode_config().query_limit == 8
  rows = [dict(batch=b, block_size=4, query_limit=q) for b, q in ((1, None), (8, 8), (32, 4), (128, 4))]
  assert auto_modes_from_frontier(rows, 4) == ((1, None), (8, 8), (32, 4))
  assert auto_modes_from_frontier(rows[1:], 4) == ((1, None), (8, 8), (32, 4))
  with pytest.raises(ValueError, match="at batch 1 .* block size 4, this engine at 8"):
    auto_modes_from_frontier(rows, 8)
  for bad, message in [(dict(policy="fast"), "policy must be one of"),
                       (dict(policy="latency", query_limit=4), "query_limit must be None"),
                       (dict(policy="throughput"), "set query_limit"),
                       (dict(policy="auto"), "needs query_limit"),
                       (dict(policy="auto", auto_modes=((8, 4), (8, 2))), "ascend strictly"),
                       (dict(policy="auto", auto_modes=((0, 4),)), "pairs of positive ints"),
                       (dict(auto_modes=((8, 4),), query_limit=2), "the 'auto' policy's table"),
                       (dict(method="ar", policy="auto", auto_modes=((8, 4),)), "needs a 'd2f' engine"),
                       (dict(cache_decided=True), "cache_decided must be a bool, True only when"),
                       (dict(cache_decided=1, query_limit=4), "cache_decided must be a bool")]:
    with pytest.raises(ValueError, match=message):
      EngineConfig(**bad)
  # The cached modes: from the frontier's rows (a cached row without a limit runs at q = the block size) and
  # into the compiled program; the sampling path is its own switch, not a temperature.
  cached = [dict(batch=1, block_size=4, query_limit=None), dict(batch=8, block_size=4, query_limit=None,
                                                                 cache_decided=True)]
  assert auto_modes_from_frontier(cached, 4, cache_decided=True) == ((1, None), (8, 4))
  with pytest.raises(ValueError, match="keeps decided K/V: serve with --cache_decided"):
    auto_modes_from_frontier(cached, 4)
  config = EngineConfig(query_limit=4, cache_decided=True, sampling=True).decode_config()
  assert config.cache_decided and config.sample and config.temperature == 0.0
  assert resolve(config, TINY_LLADA)[0].sample and not resolve(config.replace(sample=None), TINY_LLADA)[0].sample
  with pytest.raises(ValueError, match="sample must be None or a bool"):
    DecodeConfig(temperature=0.5, sample=False)


def test_a_position_budget_narrows_the_engine_under_load_and_is_exact_with_room():
  """With room to spare the budgeted engine decodes the exact tokens (each request as generate alone); with
  a tight one every request still finishes, at fewer positions per forward."""
  model = sharp_model("llada")
  roomy = Engine(model, EngineConfig(**{**ENGINE.__dict__, "position_budget": 10 ** 6}))
  results = roomy.complete(PROMPTS, SETTINGS)
  for i, got in enumerate(results):
    _check(got, _alone(model, PROMPTS[i], SETTINGS[i]), f"request {i}")
  tight = Engine(model, EngineConfig(**{**ENGINE.__dict__, "position_budget": 4}))
  narrowed = tight.complete(PROMPTS, SETTINGS)
  assert all(r.tokens and r.finish_reason in ("stop", "length") for r in narrowed)
  per_forward = sum(r.stats["position_sum"] for r in narrowed) / sum(r.forwards for r in narrowed)
  roomy_per_forward = sum(r.stats["position_sum"] for r in results) / sum(r.forwards for r in results)
  assert per_forward < roomy_per_forward, (per_forward, roomy_per_forward)


def test_bad_requests_are_refused_naming_the_field():
  engine = Engine(sharp_model("llada"), ENGINE)
  cases = [(([1] * 21, RequestSettings()), "prompt"), (([], RequestSettings()), "prompt"),
           (([10 ** 6], RequestSettings()), "prompt"), (([1.5], RequestSettings()), "prompt"),
           (([1], RequestSettings(max_new_tokens=6)), "max_new_tokens"),
           (([1], RequestSettings(max_new_tokens=32)), "max_new_tokens"),
           (([1], RequestSettings(tau_conf=1.5)), "tau_conf"), (([1], RequestSettings(method="vanilla")), "method"),
           (([1], RequestSettings(temperature=0.7)), "temperature"), (([1], RequestSettings(top_p=0.0)), "top_p"),
           (([1], RequestSettings(stop_ids=(10 ** 6,))), "stop_ids"),
           (([1], RequestSettings(stop_ids=(True,))), "stop_ids"),
           (([1], RequestSettings(tau_add="x")), "tau_add"), (([1], RequestSettings(top_k=-3)), "top_k")]
  for (prompt, settings), field in cases:
    with pytest.raises(RequestError) as error:
      engine.submit(prompt, settings)
    assert error.value.field == field, (prompt, settings, str(error.value))
  assert not engine.busy


def test_an_ar_engine_decodes_every_request_as_alone():
  """The causal baseline through an AR engine (one token per slot per step, each slot at its own position):
  tokens, forwards and trace of `generate(method='ar')` on each request alone."""
  model = sharp_model("dream")
  engine = Engine(model, EngineConfig(**{**ENGINE.__dict__, "slots": 2, "method": "ar"}))
  settings = [RequestSettings(), RequestSettings(max_new_tokens=8), RequestSettings(max_new_tokens=12),
              RequestSettings()]
  results = engine.complete(PROMPTS[:4], settings)
  for i, (prompt, s, got) in enumerate(zip(PROMPTS, settings, results)):
    result = generate(model, [prompt], DecodeConfig(method="ar", block_size=4, max_new_tokens=s.max_new_tokens or 16,
                                                    prompt_buckets=8))
    n = int(result.lengths[0])
    assert got.tokens == np.asarray(result.tokens[0, :n]).tolist(), i
    assert (got.forwards, got.trace) == (int(result.forwards[0]), np.asarray(result.trace[0]).tolist()), i
  with pytest.raises(RequestError) as error:
    engine.submit([1, 2], RequestSettings(method="d2f"))
  assert error.value.field == "method"


def test_a_failing_engine_ends_every_request_and_says_why(monkeypatch):
  """A round that raises on the engine thread ends queued and decoding requests with finish_reason 'error'
  (nothing is left waiting), load() reports the failure and new requests are refused."""
  from d2f_jax.serve import EngineStopped
  from d2f_jax.serve.programs import SlotPrograms
  engine = Engine(sharp_model("llada"), ENGINE)
  assert engine.warm_up() > 0 and not engine.busy and engine.load()["free_slots"] == ENGINE.slots

  def broken(*args, **kwargs):
    raise RuntimeError("device lost")
  monkeypatch.setattr(SlotPrograms, "advance", broken)
  finished = []
  for prompt in PROMPTS:
    engine.submit(prompt, RequestSettings(), lambda e: e.finished and finished.append(e.finish_reason))
  engine.start()
  engine.thread.join(timeout=600)
  assert finished == ["error"] * len(PROMPTS)
  assert engine.load()["error"] == "RuntimeError: device lost" and not engine.load()["admitting"]
  with pytest.raises(EngineStopped, match="device lost"):
    engine.submit(PROMPTS[0])


def test_abort_ends_every_request_at_once_and_ends_a_shutdowns_grace():
  """A server's second signal: a shutdown waiting out a long grace returns once abort() is called, every
  queued and decoding request ending with finish_reason 'cancelled' (the server's 'abort') or its full answer."""
  import threading
  import time
  engine = Engine(sharp_model("llada"), ENGINE)
  engine.warm_up()
  finished = {}
  for i, prompt in enumerate(PROMPTS * 4):  # four times the slots: most wait in the queue
    engine.submit(prompt, RequestSettings(), lambda e, i=i: e.finished and finished.setdefault(i, e.finish_reason))
  engine.start()
  stopper = threading.Thread(target=engine.shutdown, kwargs={"grace_s": 600.0})
  stopper.start()
  engine.abort()
  start = time.monotonic()
  stopper.join(timeout=300)
  assert not stopper.is_alive() and time.monotonic() - start < 300, "the grace was waited out"
  assert len(finished) == len(PROMPTS) * 4 and "cancelled" in finished.values(), finished
  assert set(finished.values()) <= {"cancelled", "stop", "length"}


def test_admission_counts_are_compiled_sizes_without_padding():
  from d2f_jax.serve.config import split_admissions
  assert EngineConfig(slots=32, max_insert=8).insert_sizes == (1, 2, 4, 8)
  assert EngineConfig(slots=6, max_insert=8).insert_sizes == (1, 2, 4)
  assert EngineConfig(slots=3, max_insert=1).insert_sizes == (1,)
  assert split_admissions(13, (1, 2, 4, 8)) == [8, 4, 1]
  assert split_admissions(7, (1, 2, 4)) == [4, 2, 1]
  assert split_admissions(3, (1,)) == [1, 1, 1]
  assert split_admissions(0, (1, 2)) == []


@pytest.mark.parametrize("method", ["d2f", "ar"])
def test_requests_prefilled_together_decode_as_alone(method):
  """Six requests admitted in one round: grouped by prompt bucket (8: three, 16: two, 24: one) and prefilled
  as insert calls of 2 + 1, 2 and 1 rows, each row with its own settings; every request still equals its
  decode alone."""
  model = sharp_model("llada")
  engine = Engine(model, EngineConfig(**{**ENGINE.__dict__, "slots": 6, "max_insert": 2, "method": method}))
  prompts = [PROMPTS[0], PROMPTS[1], [5, 6, 7, 8, 9], PROMPTS[3], PROMPTS[4], PROMPTS[2]]
  if method == "ar":
    settings = [RequestSettings(max_new_tokens=n) for n in (16, 8, 12, 16, 4, 16)]
  else:
    settings = [SETTINGS[0], SETTINGS[1], SETTINGS[2], SETTINGS[4], SETTINGS[3], SETTINGS[0]]
  results = engine.complete(prompts, settings)
  assert engine.insert_calls == 4
  for i, (prompt, s, got) in enumerate(zip(prompts, settings, results)):
    if method == "d2f":
      _check(got, _alone(model, prompt, s), f"request {i}")
      continue
    result = generate(model, [prompt], DecodeConfig(method="ar", block_size=4, max_new_tokens=s.max_new_tokens,
                                                    prompt_buckets=8))
    n = int(result.lengths[0])
    assert (got.tokens, got.forwards) == (np.asarray(result.tokens[0, :n]).tolist(), int(result.forwards[0])), i


def test_a_sampling_engine_honours_each_rows_top_k():
  """temperature 1 with top_k=1 samples the argmax: equal to the greedy decode alone, beside a greedy row and a
  row that samples freely (top_k is a per-row knob)."""
  model = sharp_model("dream")
  engine = Engine(model, EngineConfig(**{**ENGINE.__dict__, "slots": 3, "sampling": True}))
  settings = [RequestSettings(temperature=1.0, top_k=1, tau_conf=0.5), RequestSettings(tau_conf=0.5),
              RequestSettings(temperature=1.0, tau_conf=0.5)]
  results = engine.complete(PROMPTS[:3], settings)
  for i in range(2):
    _check(results[i], _alone(model, PROMPTS[i], RequestSettings(tau_conf=0.5)), f"request {i}")
  with pytest.raises(RequestError) as error:
    engine.submit(PROMPTS[0], RequestSettings(temperature=1.0, top_k=-3))
  assert error.value.field == "top_k"


def test_a_seeded_sampled_request_draws_as_generate_alone_with_its_key():
  """A request with a seed samples exactly as generate(..., key=jax.random.key(seed)) on it alone, in any slot
  and beside other sampling rows; the same seed twice gives the same answer."""
  import jax
  model = sharp_model("llada")
  engine = Engine(model, EngineConfig(**{**ENGINE.__dict__, "slots": 2, "sampling": True}))
  sampled = RequestSettings(temperature=1.0, top_p=0.95, tau_conf=0.5, tau_add=0.25, tau_act=0.5)
  seeded = [dataclasses.replace(sampled, seed=s) for s in (11, 12, 11)]
  prompts = [PROMPTS[1], PROMPTS[2], PROMPTS[1], PROMPTS[3]]
  results = engine.complete(prompts, seeded + [sampled])
  config = DecodeConfig(block_size=4, max_new_tokens=16, temperature=1.0, top_p=0.95, tau_conf=0.5, tau_add=0.25,
                        tau_act=0.5, prompt_buckets=8)
  for i, s in enumerate(seeded):
    want = generate(model, [prompts[i]], config, key=jax.random.key(s.seed))
    n = int(want.lengths[0])
    assert results[i].tokens == np.asarray(want.tokens[0, :n]).tolist(), i
    assert (results[i].forwards, results[i].trace) == (int(want.forwards[0]), np.asarray(want.trace[0]).tolist()), i
  assert results[0].tokens == results[2].tokens
  with pytest.raises(RequestError) as error:
    engine.submit(PROMPTS[0], dataclasses.replace(sampled, seed=1.5))
  assert error.value.field == "seed"
