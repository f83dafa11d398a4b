"""The serving engine on a mesh of 4 fake CPU devices (slots over data 2, heads over tensor 2) decodes every
request exactly as `generate` does on one device alone: the engine's placement is the decoder's.

One child process (XLA_FLAGS must be set before JAX starts) runs a sharded LLaDA-layout engine with 4 slots over
6 requests of ragged prompt and answer lengths (slots refilled), blocking on every result.
"""

import json
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CHILD = textwrap.dedent("""
    import json
    import jax, numpy as np
    jax.config.update("jax_default_matmul_precision", "highest")
    jax.config.update("jax_disable_most_optimizations", True)
    from d2f_jax.decode import DecodeConfig, generate
    from d2f_jax.serve import Engine, EngineConfig, RequestSettings
    from d2f_jax.sharding import make_mesh
    from test_decode import sharp_model

    assert jax.device_count() == 4, jax.devices()
    model = sharp_model("llada")
    sharded = model.shard(make_mesh(dict(data=2, tensor=2)))
    prompts = [[11, 23, 5], [3, 14, 15, 92, 65, 35, 89, 79, 32], [99, 98], [2, 71, 82, 81, 82, 84], [7], [40, 41, 42]]
    settings = [RequestSettings(tau_conf=0.5, tau_add=0.25, tau_act=0.5, max_new_tokens=n) for n in (16, 8, 16, 12, 16, 8)]
    engine = Engine(sharded, EngineConfig(slots=4, block_size=4, max_new_tokens=16, max_prompt_len=12, prompt_bucket=8,
                                          steps_per_call=3))
    got = engine.complete(prompts, settings)
    cases = []
    for prompt, s, c in zip(prompts, settings, got):
      r = generate(model, [prompt], DecodeConfig(block_size=4, max_new_tokens=s.max_new_tokens, tau_conf=0.5,
                                                 tau_add=0.25, tau_act=0.5, prompt_buckets=8))
      n = int(r.lengths[0])
      want = dict(tokens=np.asarray(r.tokens[0, :n]).tolist(), forwards=int(r.forwards[0]),
                  trace=np.asarray(r.trace[0]).tolist())
      cases.append({"want": want, "got": dict(tokens=c.tokens, forwards=c.forwards, trace=c.trace)})
    kv = engine.batch.state.cache.k.sharding.spec
    print("RESULT" + json.dumps({"cases": cases, "cache_spec": [list(e) if isinstance(e, tuple) else e for e in kv]}))
""")


def test_a_sharded_engine_decodes_every_request_as_one_device_alone():
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu",
         "TF_CPP_MIN_LOG_LEVEL": "3",
         "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH", "")])}
  proc = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=540, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-4000:]
  out = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))[len("RESULT"):])
  for i, case in enumerate(out["cases"]):
    assert case["got"] == case["want"], (i, case)
  assert any(len(c["got"]["tokens"]) > 4 for c in out["cases"])  # real answers, several blocks long
  assert out["cache_spec"][1] in ("data", ["data"])  # the slots' KV cache rows are split over the data axis


def test_the_ahead_of_time_engine_programs_follow_the_engine_config():
  """serve/aot.py builds its programs from EngineConfig.decode_config(), as the engine does: an 'ar' engine's
  advance program carries the AR loop state (it once compiled the D2F one whatever the method), and a
  query-limited engine's spec carries its limit."""
  import jax
  from d2f_jax.decode import baselines, pipeline
  from d2f_jax.serve import EngineConfig
  from d2f_jax.serve.aot import engine_programs
  from d2f_jax.sharding import make_mesh
  from test_decode import sharp_model

  model = sharp_model("llada")
  mesh = make_mesh(dict(data=1), jax.devices()[:1])
  base = dict(slots=2, block_size=4, max_new_tokens=16, max_prompt_len=16, prompt_bucket=8)
  for method, state_type in (("ar", baselines.ARState), ("d2f", pipeline.D2FState)):
    _, (programs, params, batch) = engine_programs(model.config, EngineConfig(method=method, **base),
                                                   mesh)["serve_advance"]
    assert isinstance(batch.state, state_type), (method, type(batch.state))
    assert programs.spec.method == method
  config = EngineConfig(query_limit=2, **base)
  assert config.decode_config().query_limit == 2 and config.decode_config().method == "d2f"
