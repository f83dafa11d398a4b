"""The engine serving LLaDA2 with its own released block sampler (EngineConfig.method 'llada2'), LLaDA2.0's
and LLaDA2.1's token editing: every request, whenever it arrives and whatever shares the slots, decodes as
`generate` decodes it alone (tokens, forwards, acceptance trace), its stream never sends a token an edit later
rewrites, and the OpenAI server serves it through the official client."""

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import d2f_jax
from d2f_jax.convert import synthetic
from d2f_jax.decode import DecodeConfig, generate
from d2f_jax.models.config import TINY_LLADA2
from d2f_jax.serve import Engine, EngineConfig, RequestSettings
from d2f_jax.serve.types import RequestError

BLOCK, BOUND = 4, 12
PROMPTS = [[11, 23, 5, 101, 7], [3, 14, 15, 92, 65, 35, 89, 79, 32], [99, 98], [5, 6, 7, 8, 9, 10, 11, 12]]


@pytest.fixture(scope="module")
def sharp():
  """A random tiny LLaDA2 (block-causal) with a 4x head, so confidences spread over (0, 1) as a trained one's."""
  from d2f_jax.api import Model
  from model_utils import random_model
  module = random_model(TINY_LLADA2.replace(attention_kind="block_causal"), seed=0)
  module.lm_head[...] = module.lm_head[...] * 4.0
  return Model.from_module(module)


def _engine(model, **overrides):
  config = dict(slots=2, method="llada2", block_size=BLOCK, max_new_tokens=BOUND, max_prompt_len=12,
                prompt_bucket=8, steps_per_call=2, max_insert=2)
  return Engine(model, EngineConfig(**{**config, **overrides}))


def _alone(model, prompt, engine: EngineConfig, s: RequestSettings):
  """`generate` on the request alone, with the settings the engine resolves for it."""
  editing = {} if engine.editing_threshold is None else dict(
      editing_threshold=engine.editing_threshold if s.editing_threshold is None else s.editing_threshold,
      max_post_steps=engine.max_post_steps if s.max_post_steps is None else s.max_post_steps)
  config = DecodeConfig(method="llada2", block_size=BLOCK, max_new_tokens=s.max_new_tokens or BOUND,
                        tau_conf=s.tau_conf, steps=engine.steps, stop_ids=s.stop_ids, prompt_buckets=8,
                        block_cache=engine.block_cache, **editing)
  return generate(model, [prompt], config)


def _assert_as_alone(model, engine, prompts, settings, results):
  for prompt, s, got in zip(prompts, settings, results):
    alone = _alone(model, prompt, engine.config, s)
    where = f"prompt {prompt}, {s}"
    assert got.tokens == np.asarray(alone.tokens[0, :int(alone.lengths[0])]).tolist(), where
    assert got.forwards == int(alone.forwards[0]), where
    assert got.trace == np.asarray(alone.trace[0]).tolist(), where


@pytest.mark.parametrize("block_cache", [False, True])
def test_llada20s_sampler_serves_every_request_as_alone(sharp, block_cache):
  """Two slots, six requests of three prompt buckets, thresholds, answer bounds and steps per block: slots are
  refilled while the other decodes, and each answer is its batch-1 decode (the released loop, or with the
  cache of finished blocks, whose slots the engine prefills and pads as d2f's)."""
  engine = _engine(sharp, steps=2, block_cache=block_cache)
  settings = [RequestSettings(), RequestSettings(tau_conf=0.5), RequestSettings(max_new_tokens=8, stop_ids=()),
              RequestSettings(tau_conf=0.3), RequestSettings(tau_conf=0.99, max_new_tokens=4), RequestSettings()]
  prompts = PROMPTS + PROMPTS[:2][::-1]
  results = engine.complete(prompts, settings)
  _assert_as_alone(sharp, engine, prompts, settings, results)
  assert engine.insert_calls >= 3 and any(r.tokens != results[0].tokens for r in results[1:])
  assert {r.finish_reason for r in results} <= {"stop", "length"}


@pytest.mark.parametrize("block_cache", [False, True])
def test_llada21s_editing_serves_as_alone_and_streams_only_final_tokens(sharp, block_cache):
  """The editing engine (quality mode by default; requests choose their own threshold and post-fill steps):
  answers equal their batch-1 decodes, and the ids each request's events carry add up to its answer though
  later forwards rewrote tokens of the blocks in flight (so a streamed token is never taken back)."""
  engine = _engine(sharp, editing_threshold=0.5, max_post_steps=16, block_cache=block_cache)
  settings = [RequestSettings(tau_conf=0.7, stop_ids=()), RequestSettings(tau_conf=0.5, editing_threshold=0.0,
                                                                           max_post_steps=3, stop_ids=()),
              RequestSettings(tau_conf=0.9, max_post_steps=0), RequestSettings(tau_conf=0.5, editing_threshold=0.0,
                                                                               max_post_steps=3)]
  streamed = {i: [] for i in range(len(PROMPTS))}
  finals = {}

  def on_event(i):
    def callback(event):
      streamed[i].extend(event.ids)
      if event.finished:
        finals[i] = event.completion
    return callback
  for i, (prompt, s) in enumerate(zip(PROMPTS, settings)):
    engine.submit(prompt, s, on_event(i))
  engine.run_until_idle()
  results = [finals[i] for i in range(len(PROMPTS))]
  _assert_as_alone(sharp, engine, PROMPTS, settings, results)
  for i, got in enumerate(results):
    assert streamed[i] == got.tokens, i
  plain = _engine(sharp).complete(PROMPTS, [s.__class__(tau_conf=s.tau_conf, stop_ids=s.stop_ids) for s in settings])
  assert [r.tokens for r in plain] != [r.tokens for r in results]  # editing changed some answer


def test_sampled_requests_draw_as_generate_alone_with_their_seed(sharp):
  """A sampling editing engine: each request's answer is generate's with key(seed) alone, whatever shares it."""
  import jax
  engine = _engine(sharp, sampling=True, editing_threshold=0.5)
  settings = [RequestSettings(temperature=0.8, top_p=0.9, seed=7 + i, stop_ids=()) for i in range(3)]
  results = engine.complete(PROMPTS[:3], settings)
  for prompt, s, got in zip(PROMPTS[:3], settings, results):
    config = DecodeConfig(method="llada2", block_size=BLOCK, max_new_tokens=BOUND, temperature=0.8, top_p=0.9,
                          stop_ids=(), prompt_buckets=8, editing_threshold=0.5)
    alone = generate(sharp, [prompt], config, key=jax.random.key(s.seed))
    assert got.tokens == np.asarray(alone.tokens[0, :int(alone.lengths[0])]).tolist(), prompt
    assert got.forwards == int(alone.forwards[0]), prompt
  assert len({tuple(r.tokens) for r in results}) == 3


def test_settings_a_llada2_engine_cannot_run_are_refused_by_name(sharp):
  plain = _engine(sharp)
  for settings, field in ((RequestSettings(editing_threshold=0.5), "editing_threshold"),
                          (RequestSettings(max_post_steps=4), "max_post_steps"),
                          (RequestSettings(method="d2f"), "method")):
    with pytest.raises(RequestError) as error:
      plain.submit([5, 6], settings)
    assert error.value.field == field
  with pytest.raises(RequestError) as error:
    _engine(sharp, editing_threshold=0.5).submit([5, 6], RequestSettings(editing_threshold=1.5))
  assert error.value.field == "editing_threshold"
  for kw in (dict(editing_threshold=0.5), dict(block_cache=True)):
    with pytest.raises(ValueError, match="settings of a 'llada2' engine"):
      EngineConfig(method="d2f", **kw)
  with pytest.raises(ValueError, match="query_limit .* on a 'd2f' engine"):
    EngineConfig(method="llada2", query_limit=4, policy="throughput")


def test_batched_evaluation_decodes_llada2_through_the_engine(sharp):
  """evaluate's batch > 1 path (evals/engine_pass.py) runs method 'llada2' in a llada2 engine with the
  config's editing: every answer equals batch one."""
  from d2f_jax.evals.engine_pass import engine_fits, run_engine
  config = DecodeConfig(method="llada2", block_size=BLOCK, max_new_tokens=8, tau_conf=0.5, editing_threshold=0.0,
                        max_post_steps=2, prompt_buckets=8, stop_ids=())
  assert engine_fits(config, 3)
  out = run_engine(sharp, PROMPTS, config, slots=3, warmup="none")
  for prompt, tokens, forwards in zip(PROMPTS, out["tokens"], out["forwards"]):
    alone = generate(sharp, [prompt], config)
    assert tokens == np.asarray(alone.tokens[0, :int(alone.lengths[0])]).tolist(), prompt
    assert forwards == int(alone.forwards[0]), prompt


def test_the_openai_server_serves_llada21s_editing(tmp_path):
  """`python -m d2f_jax.serve --method llada2 --editing_threshold 0.5` on a tiny LLaDA2 checkpoint, driven by
  the official openai client: completions (the server's editing, and a request's own threshold and post-fill
  steps as extra fields) and a stream equal batch-one generate; a d2f request is refused naming `method`."""
  import openai
  from test_serve_server import Server
  checkpoint = tmp_path / "tiny_llada2"
  synthetic.write_hf_checkpoint(checkpoint, TINY_LLADA2, seed=0, dtype="float32")
  weights = load_file(str(checkpoint / "model.safetensors"))
  weights["lm_head.weight"] = weights["lm_head.weight"] * 4.0  # clear greedy choices
  save_file(weights, str(checkpoint / "model.safetensors"), metadata={"format": "pt"})
  server = Server(checkpoint, tmp_path / "server.log", ("--method", "llada2", "--editing_threshold", "0.5"))
  try:
    prompts = ["w5 w7 w9", "w11 w13 w17 w19 w23"]
    model = d2f_jax.load_model(str(checkpoint))
    common = dict(method="llada2", prompt_buckets=32, block_size=4, max_new_tokens=16)
    quality = model.generate(prompts, editing_threshold=0.5, tau_conf=0.7, **common)
    speed = model.generate(prompts, editing_threshold=0.0, max_post_steps=3, tau_conf=0.5, **common)
    assert all(quality) and quality != speed, (quality, speed)
    server.wait_ready()
    for prompt, want_quality, want_speed in zip(prompts, quality, speed):
      got = server.client.completions.create(model="tiny", prompt=prompt, max_tokens=16,
                                             extra_body={"tau_conf": 0.7})
      assert got.choices[0].text == want_quality, prompt
      got = server.client.completions.create(model="tiny", prompt=prompt, max_tokens=16, extra_body=dict(
          tau_conf=0.5, editing_threshold=0.0, max_post_steps=3))
      assert got.choices[0].text == want_speed, prompt
    chunks = list(server.client.completions.create(model="tiny", prompt=prompts[1], stream=True,
                                                   extra_body={"tau_conf": 0.7}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == quality[1]
    with pytest.raises(openai.BadRequestError) as error:
      server.client.completions.create(model="tiny", prompt=prompts[0], extra_body={"method": "d2f"})
    assert error.value.body["param"] == "method"
  finally:
    server.stop()
