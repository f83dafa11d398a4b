"""Sharded decoding on 8 fake CPU devices is token-identical to one device.

Every decoder's result (tokens, lengths, forwards, steps, acceptance trace, d2f diagnostics) on meshes of
tensor 2 / 4 / 8, data 2 and data 2 x tensor 4 equals the one-device result exactly, for a tiny LLaDA (MHA)
and a tiny Dream (GQA: 2 kv heads, so tensor 4 / 8 splits query heads only; the two share the meshes out),
with XLA attention and with the Pallas kernels in interpret mode. Three prompts on data 2 exercise the row
padding. One child process runs everything (XLA_FLAGS must be set before JAX starts) and blocks on every result.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CHILD = textwrap.dedent("""
    import dataclasses, json, sys, tempfile, time
    import jax, jax.numpy as jnp, numpy as np
    jax.config.update("jax_default_matmul_precision", "highest")
    jax.config.update("jax_disable_most_optimizations", True)
    from jax.sharding import NamedSharding, PartitionSpec as P
    import d2f_jax
    from d2f_jax.api import Model
    from d2f_jax.decode import DecodeConfig, decode_program, generate, generate_stepwise, trace_count
    from d2f_jax.decode import runner
    from d2f_jax.decode.runner import pack_prompts, resolve, with_attention
    from d2f_jax.models import TINY_DREAM, TINY_LLADA
    from d2f_jax.sharding import make_mesh
    from model_utils import random_model

    assert jax.device_count() == 8, jax.devices()
    MESHES = {"t2": dict(tensor=2), "t4": dict(tensor=4), "t8": dict(tensor=8), "d2": dict(data=2),
              "d2t4": dict(data=2, tensor=4)}
    BASE = DecodeConfig(block_size=4, max_new_tokens=16, max_blocks_in_flight=2, tau_conf=0.02, prompt_buckets=8)
    TAU = {"llada": 0.02, "dream": 0.05}  # low enough for a random tiny model to accept several tokens a step
    PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [13]]
    MODELS = {"llada": Model.from_module(random_model(TINY_LLADA, seed=0)),
              "dream": Model.from_module(random_model(TINY_DREAM, seed=3))}

    def mesh(name):
      sizes = MESHES[name]
      return make_mesh(sizes, jax.devices()[:int(np.prod(list(sizes.values())))])

    def host(result):
      return {k: np.asarray(v).tolist() for k, v in dataclasses.asdict(result).items()}

    def spec(x):  # a dimension's mesh axes, one entry per dimension
      entries = list(x.sharding.spec) + [None] * (x.ndim - len(x.sharding.spec))
      return [list(e) if isinstance(e, tuple) else e for e in entries]

    def diff(a, b):
      return sorted(k for k in a if a[k] != b[k])

    out = {"cases": {}}
    refs = {}
    def case(model_name, mesh_name, method="d2f", impl="xla", **changes):
      start = time.perf_counter()
      config = BASE.replace(method=method, tau_conf=TAU[model_name], **changes)
      model = MODELS[model_name]
      key = (model_name, method, tuple(sorted(changes.items())))
      if key not in refs:
        refs[key] = host(jax.block_until_ready(generate(model, PROMPTS, config, key=jax.random.key(7))))
      if impl != "xla":
        model = with_attention(model, impl)
      sharded = model.shard(mesh(mesh_name))
      got = host(jax.block_until_ready(generate(sharded, PROMPTS, config, key=jax.random.key(7))))
      name = f"{model_name}-{mesh_name}-{method}-{impl}" + "".join(f"-{k}{v}" for k, v in changes.items())
      out["cases"][name] = {"diff": diff(refs[key], got), "ref": refs[key], "got": got,
                            "seconds": round(time.perf_counter() - start, 2)}
      return sharded, config

    # Each model on tensor 2 / 4 / 8 and data 2 between them (LLaDA MHA, Dream GQA incl. tensor > kv heads),
    # both on the 2-D mesh; the method / kernel cases below add Dream t2 and d2t4, LLaDA t4.
    for m, meshes in (("llada", ("t2", "t8", "d2", "d2t4")), ("dream", ("t4", "t8", "d2t4"))):
      for mesh_name in meshes:
        case(m, mesh_name)
    case("llada", "d2t4", "threshold")
    case("dream", "t2", "ar")
    case("llada", "t4", "vanilla", steps=8)
    case("dream", "d2t4", "dream_vanilla", steps=8)
    case("dream", "d2", temperature=0.8)  # sampling: the padding row must not shift the draws
    case("dream", "t2", impl="interpret_gpu")
    case("dream", "d2t4", impl="interpret_gpu")
    case("llada", "t4", impl="interpret_gpu")
    case("llada", "d2t4", query_limit=2)  # the query-limited mode's gathers of window columns, rows split
    case("dream", "t4", impl="interpret_gpu", query_limit=2)

    # The interpreted kernels really run per shard (XLA cannot partition a Pallas call): the lowered loop
    # holds a manual (shard_map) region.
    def has_shard_map(model):
      prep = runner.prepare(model, PROMPTS, BASE, None, None, None, None)
      text = runner.run_loop.lower(model.graphdef, prep.params, prep.prompt, prep.prompt_len, prep.key,
                                    prep.knobs, spec=prep.spec, layout=prep.layout).as_text()
      return "sdy.manual_computation" in text or "SPMDFullToShardShape" in text
    out["kernel_shard_map"] = has_shard_map(with_attention(MODELS["dream"], "interpret_gpu").shard(mesh("d2t4")))
    out["xla_shard_map"] = has_shard_map(MODELS["dream"].shard(mesh("d2t4")))  # XLA partitions the reference

    # The reference is not trivially equal: a different model gives different tokens.
    other = host(generate(Model.from_module(random_model(TINY_LLADA, seed=1)), PROMPTS, BASE))
    out["other_model_diff"] = diff(refs[("llada", "d2f", ())], other)

    # Same shapes, new prompts and knobs: no retrace; the stepwise driver gives the same result.
    sharded = MODELS["llada"].shard(mesh("d2t4"))
    before = trace_count("loop")
    again = host(generate(sharded, [[9, 9], [3], [4, 4, 4, 4]], BASE.replace(tau_conf=0.5)))
    single = host(generate(MODELS["llada"], [[9, 9], [3], [4, 4, 4, 4]], BASE.replace(tau_conf=0.5)))
    out["retraces"] = trace_count("loop") - before  # both shapes were compiled above
    out["again_diff"] = diff(single, again)
    out["stepwise_diff"] = diff(refs[("llada", "d2f", ())], host(generate_stepwise(sharded, PROMPTS, BASE)))
    state, prep = next(runner._steps(sharded, PROMPTS, BASE, None, None))
    out["layouts"] = {"cache_k": spec(state.cache.k), "tokens": spec(state.tokens), "rows": int(state.tokens.shape[0]),
                      "q": spec(sharded.state["layers"]["q"][...]), "embedding": spec(sharded.state["embedding"][...])}
    dream_state, _ = next(runner._steps(MODELS["dream"].shard(mesh("t8")), PROMPTS, BASE, None, None))
    out["layouts"]["dream_t8_cache_k"] = spec(dream_state.cache.k)

    # Ahead-of-time: the program over abstract inputs compiles, and run on real ones equals generate.
    program = decode_program(TINY_LLADA, BASE, batch=3, prompt_width=8, mesh=mesh("d2t4"))
    compiled = program.lower().compile()
    prompt, prompt_len = pack_prompts(PROMPTS, BASE, TINY_LLADA)
    prompt = jnp.concatenate([prompt, prompt[:1]]); prompt_len = jnp.concatenate([prompt_len, prompt_len[:1]])
    _, knobs = resolve(BASE, TINY_LLADA)
    args = [sharded.state, prompt, prompt_len, jax.random.key(0), knobs]
    args = [jax.tree.map(lambda x, a: jax.device_put(x, a.sharding), x, a) for x, a in zip(args, program.args)]
    aot = host(jax.tree.map(lambda x: x[:3], jax.block_until_ready(compiled(*args))))
    out["aot"] = {"batch": program.batch, "diff": diff(host(generate(sharded, PROMPTS, BASE)), aot),
                  "prompt_sharding": list(program.args[1].sharding.spec)}

    # load_model(mesh=...) places a checkpoint straight into its shardings and decodes the same.
    from d2f_jax.convert.synthetic import write_hf_checkpoint
    path = write_hf_checkpoint(tempfile.mkdtemp(), TINY_DREAM, seed=0, dtype="float32")
    plain = d2f_jax.load_model(path)
    placed = d2f_jax.load_model(path, mesh=mesh("d2t4"))
    out["load"] = {"q": spec(placed.state["layers"]["q"][...]), "mesh": dict(placed.mesh.shape),
                   "diff": diff(host(generate(plain, PROMPTS, BASE)), host(generate(placed, PROMPTS, BASE)))}
    print("RESULT" + json.dumps(out))
""")


@pytest.fixture(scope="module")
def runs():
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
         "TF_CPP_MIN_LOG_LEVEL": "3",
         "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH", "")])}
  proc = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=540,
                        cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-4000:]
  line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
  return json.loads(line[len("RESULT"):])


CASES = ([f"llada-{mesh}-d2f-xla" for mesh in ("t2", "t8", "d2", "d2t4")]
         + [f"dream-{mesh}-d2f-xla" for mesh in ("t4", "t8", "d2t4")]
         + ["llada-d2t4-threshold-xla", "dream-t2-ar-xla", "llada-t4-vanilla-xla-steps8",
            "dream-d2t4-dream_vanilla-xla-steps8", "dream-d2-d2f-xla-temperature0.8",
            "dream-t2-d2f-interpret_gpu", "dream-d2t4-d2f-interpret_gpu", "llada-t4-d2f-interpret_gpu",
            "llada-d2t4-d2f-xla-query_limit2", "dream-t4-d2f-interpret_gpu-query_limit2"])


@pytest.mark.parametrize("name", CASES)
def test_sharded_decode_equals_one_device(runs, name):
  r = runs["cases"][name]
  assert r["diff"] == [], (name, r["diff"], r["ref"], r["got"])
  # The case decodes something real: three rows of tokens, at least one step taking several tokens
  # (d2f) so acceptance and block bookkeeping run in parallel on the mesh.
  assert len(r["got"]["tokens"]) == 3 and all(n > 0 for n in r["got"]["lengths"])
  if "-d2f-" in name and "temperature" not in name:
    assert max(r["got"]["max_accepted"]) > 1, r["got"]


def test_reference_is_not_trivially_equal(runs):
  assert "tokens" in runs["other_model_diff"]


def test_kernels_run_inside_shard_map(runs):
  assert runs["kernel_shard_map"] and not runs["xla_shard_map"]


def test_no_recompiles_and_stepwise_agrees(runs):
  assert runs["retraces"] == 0
  assert runs["again_diff"] == [] and runs["stepwise_diff"] == []


def test_cache_weights_and_rows_are_really_split(runs):
  layouts = runs["layouts"]
  assert layouts["cache_k"] == [None, "data", None, "tensor", None]  # [L, B, S, K, D]
  assert layouts["tokens"] == ["data", None] and layouts["rows"] == 4  # 3 rows padded to 4
  assert layouts["q"] == [None, None, "tensor"]  # [L, E, H*D], whole heads over tensor
  assert layouts["embedding"] == ["tensor", None]  # vocab over tensor
  # Dream's 2 kv heads do not divide tensor 8: the cache stays whole across it (not an error).
  assert layouts["dream_t8_cache_k"] == [None] * 5


def test_decode_program_compiles_ahead_of_time_and_matches(runs):
  assert runs["aot"]["batch"] == 4 and runs["aot"]["prompt_sharding"] == ["data", None]
  assert runs["aot"]["diff"] == []


def test_load_model_onto_a_mesh(runs):
  assert runs["load"]["mesh"] == {"data": 2, "fsdp": 1, "tensor": 4}
  assert runs["load"]["q"] == [None, None, "tensor"]
  assert runs["load"]["diff"] == []
