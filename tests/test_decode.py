"""The jitted decoders agree token for token with the plain step-by-step references (fp32, greedy)."""

import numpy as np
import pytest

import decode_reference as ref
from d2f_jax.api import Model
from d2f_jax.decode import DecodeConfig, generate, generate_stepwise, stream, trace_count
from d2f_jax.models import TINY_DREAM, TINY_LLADA
from model_utils import random_model

CONFIGS = {"llada": TINY_LLADA, "dream": TINY_DREAM}
# Prompt lengths 5 / 9 / 12 with block 4: responses start off and on block multiples.
PROMPTS = [[11, 23, 5, 101, 7], [3, 14, 15, 92, 65, 35, 89, 79, 32], [2, 71, 82, 81, 82, 84, 59, 4, 52, 35, 36, 2]]
BASE = DecodeConfig(block_size=4, max_new_tokens=16, max_blocks_in_flight=3, prompt_buckets=16)
# (tau_conf, tau_add, tau_act): the paper's defaults, then settings that accept several tokens per step and
# keep several (semi-activated) blocks in flight, then one token per step.
THRESHOLDS = [(0.9, 0.1, 0.95), (0.5, 0.25, 0.5), (0.3, 0.0, 0.75), (1.0, 0.5, 1.0)]
_MODELS = {}


def sharp_model(family: str) -> Model:
  """A random tiny model with a 4x head, so top-1 probabilities spread over (0, 1) as a trained one's do."""
  if family not in _MODELS:
    module = random_model(CONFIGS[family], seed=0)
    module.lm_head[...] = module.lm_head[...] * 4.0
    _MODELS[family] = Model.from_module(module)
  return _MODELS[family]


def _stops(model, config):
  c = model.config
  return set(config.stop_ids) if config.stop_ids is not None else {c.eos_token_id, c.eot_token_id}


def d2f_reference(model, prompt, config):
  run = config.effective()
  return ref.d2f(model, prompt, block_size=run.block_size, max_new_tokens=run.max_new_tokens,
                 max_blocks_in_flight=run.max_blocks_in_flight, tau_add=run.tau_add, tau_act=run.tau_act,
                 tau_conf=run.tau_conf, stop_ids=_stops(model, run))


def assert_rows_match(result, expected, prompts, *, stats=True):
  for b, (want, prompt) in enumerate(zip(expected, prompts)):
    where = f"row {b} (prompt of {len(prompt)} tokens)"
    np.testing.assert_array_equal(np.asarray(result.tokens[b]), want["tokens"], err_msg=where)
    assert int(result.lengths[b]) == want["length"], where
    assert int(result.forwards[b]) == want["forwards"], where
    np.testing.assert_array_equal(np.asarray(result.trace[b]), want["trace"], err_msg=where)
    if stats:
      for name in ("max_in_flight", "semi_steps", "max_accepted"):
        assert int(getattr(result, name)[b]) == want[name], (where, name)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_d2f_matches_reference_across_thresholds(family):
  model = sharp_model(family)
  seen = dict(multi_accept=False, semi=False, pipelined=False)
  for tau_conf, tau_add, tau_act in THRESHOLDS:
    config = BASE.replace(tau_conf=tau_conf, tau_add=tau_add, tau_act=tau_act)
    result = generate(model, PROMPTS, config)
    expected = [d2f_reference(model, p, config) for p in PROMPTS]
    assert_rows_match(result, expected, PROMPTS)
    seen["multi_accept"] |= bool((np.asarray(result.max_accepted) > 1).any())
    seen["semi"] |= bool((np.asarray(result.semi_steps) > 0).any())
    seen["pipelined"] |= bool((np.asarray(result.max_in_flight) >= 2).any())
  assert all(seen.values()), seen


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_d2f_matches_reference_other_shapes(family):
  """Block 8, a longer response, a tight in-flight bound (tau_add 0 keeps it binding), full length."""
  model = sharp_model(family)
  config = DecodeConfig(block_size=8, max_new_tokens=24, max_blocks_in_flight=2, tau_conf=0.6, tau_add=0.0,
                        tau_act=0.5, stop_ids=(), prompt_buckets=16)
  result = generate(model, PROMPTS, config)
  assert_rows_match(result, [d2f_reference(model, p, config) for p in PROMPTS], PROMPTS)
  np.testing.assert_array_equal(np.asarray(result.lengths), 24)  # max length reached
  np.testing.assert_array_equal(np.asarray(result.max_in_flight), 2)


def test_single_block_and_a_prompt_that_fills_its_bucket():
  model = sharp_model("dream")
  prompts = [list(range(40, 56)), [9, 8, 7]]  # 16 tokens = the bucket (no padding), and 3
  config = DecodeConfig(block_size=8, max_new_tokens=8, max_blocks_in_flight=4, tau_conf=0.5, prompt_buckets=16)
  result = generate(model, prompts, config)
  assert_rows_match(result, [d2f_reference(model, p, config) for p in prompts], prompts)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_stop_token_in_first_block(family):
  """A stop token accepted in block 0 ends appending; the rest is padding; trace shows unappended blocks."""
  model = sharp_model(family)
  config = BASE.replace(tau_conf=0.9, tau_add=0.5, tau_act=0.95)
  free = d2f_reference(model, PROMPTS[0], config.replace(stop_ids=()))
  stop = int(free["tokens"][1])  # make what the model writes at response position 1 the stop token
  config = config.replace(stop_ids=(stop,))
  result = generate(model, PROMPTS, config)
  expected = [d2f_reference(model, p, config) for p in PROMPTS]
  assert_rows_match(result, expected, PROMPTS)
  assert int(result.lengths[0]) <= 2
  assert int(result.forwards[0]) < free["forwards"]
  assert (np.asarray(result.tokens[0, 2:]) == model.config.pad_token_id).all()
  assert (np.asarray(result.trace[0, -config.block_size:]) == -1).all()  # the last block was never appended


def assert_rows_decode_as_alone(model, prompts, config):
  """Each row of a batched decode equals the same prompt decoded alone; returns the batch's result."""
  batch = generate(model, prompts, config)
  for b, prompt in enumerate(prompts):
    alone = generate(model, [prompt], config)
    for name in ("tokens", "lengths", "forwards", "trace", "max_in_flight", "semi_steps", "max_accepted"):
      np.testing.assert_array_equal(np.asarray(getattr(batch, name)[b]), np.asarray(getattr(alone, name)[0]),
                                    err_msg=f"{name} row {b}")
  return batch


def test_batch_rows_decode_as_alone():
  assert_rows_decode_as_alone(sharp_model("llada"), PROMPTS, BASE.replace(tau_conf=0.5, tau_add=0.25, tau_act=0.5))


def test_no_recompile_within_a_prompt_bucket():
  model = sharp_model("llada")
  generate(model, PROMPTS, BASE)
  before = trace_count("loop")
  other = [[5] * 16, [7, 8], [9] * 13]  # other lengths, same bucket of 16
  generate(model, other, BASE.replace(tau_conf=0.3, tau_add=0.6, tau_act=0.2, stop_ids=(5, 6)))
  generate(model, np.asarray([[1, 2, 3, 4]] * 3), BASE, mask=np.asarray([[0, 1, 1, 1]] * 3))
  assert trace_count("loop") == before
  generate(model, [[1] * 17, [2], [3]], BASE)  # next bucket (32): one new program
  assert trace_count("loop") == before + 1


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_threshold_is_d2f_with_one_block_and_tau_add_one(family):
  model = sharp_model(family)
  threshold = DecodeConfig(method="threshold", block_size=4, max_new_tokens=16, tau_conf=0.5, prompt_buckets=16)
  result = generate(model, PROMPTS, threshold)
  same = generate(model, PROMPTS, threshold.replace(method="d2f", tau_add=1.0, max_blocks_in_flight=1))
  for name in ("tokens", "forwards", "trace"):
    np.testing.assert_array_equal(np.asarray(getattr(result, name)), np.asarray(getattr(same, name)))
  assert_rows_match(result, [d2f_reference(model, p, threshold) for p in PROMPTS], PROMPTS)
  assert (np.asarray(result.max_in_flight) == 1).all()


def test_llada_vanilla_matches_reference():
  model = sharp_model("llada")
  config = DecodeConfig(method="vanilla", block_size=4, max_new_tokens=16, steps=12, prompt_buckets=16)
  result = generate(model, PROMPTS, config)
  expected = [ref.llada_vanilla(model, p, block_size=4, max_new_tokens=16, steps=12,
                                stop_ids=_stops(model, config)) for p in PROMPTS]
  assert_rows_match(result, expected, PROMPTS, stats=False)


@pytest.mark.parametrize("alg", ["confidence", "entropy", "margin"])
def test_dream_vanilla_matches_reference(alg):
  model = sharp_model("dream")
  config = DecodeConfig(method="dream_vanilla", block_size=4, max_new_tokens=16, steps=6, alg=alg,
                        prompt_buckets=16)
  result = generate(model, PROMPTS, config)
  expected = [ref.dream_vanilla(model, p, max_new_tokens=16, steps=6, alg=alg, stop_ids=_stops(model, config))
              for p in PROMPTS]
  assert_rows_match(result, expected, PROMPTS, stats=False)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_cached_ar_matches_causal_recompute(family):
  model = sharp_model(family)
  free = ref.causal_greedy(model, PROMPTS[1], max_new_tokens=12, stop_ids=set())
  stops = (int(free["tokens"][4]),)  # row 1 stops early, the others when (if) they meet it
  config = DecodeConfig(method="ar", block_size=1, max_new_tokens=12, stop_ids=stops, prompt_buckets=16)
  result = generate(model, PROMPTS, config)
  expected = [ref.causal_greedy(model, p, max_new_tokens=12, stop_ids=set(stops)) for p in PROMPTS]
  assert_rows_match(result, expected, PROMPTS, stats=False)
  assert int(result.lengths[1]) <= 5


def test_sampling_is_keyed_and_top_p_tiny_is_greedy():
  import jax
  model = sharp_model("llada")
  config = BASE.replace(tau_conf=0.5, tau_add=0.25, tau_act=0.5, temperature=1.0, top_p=0.95)
  a = generate(model, PROMPTS, config, key=jax.random.key(1))
  b = generate(model, PROMPTS, config, key=jax.random.key(1))
  c = generate(model, PROMPTS, config, key=jax.random.key(2))
  np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
  assert (np.asarray(a.tokens) != np.asarray(c.tokens)).any()
  assert (np.asarray(a.tokens) != model.config.mask_token_id).all()
  greedy = generate(model, PROMPTS, config.replace(temperature=0.0, top_p=1.0))
  nucleus = generate(model, PROMPTS, config.replace(top_p=1e-6), key=jax.random.key(3))
  top_one = generate(model, PROMPTS, config.replace(top_p=1.0, top_k=1), key=jax.random.key(3))
  for name in ("tokens", "forwards", "trace"):
    np.testing.assert_array_equal(np.asarray(getattr(nucleus, name)), np.asarray(getattr(greedy, name)))
    np.testing.assert_array_equal(np.asarray(getattr(top_one, name)), np.asarray(getattr(greedy, name)))


def test_a_sampled_row_draws_from_its_own_key_whatever_shares_the_batch():
  """Row i of a batch samples with fold_in(key, i): row 0 of a batch equals that prompt decoded alone with the
  same key (tokens, forwards, trace), for d2f and the cached AR decoder."""
  import jax
  model = sharp_model("dream")
  for config in (BASE.replace(tau_conf=0.5, tau_add=0.25, tau_act=0.5, temperature=1.0),
                 DecodeConfig(method="ar", block_size=1, max_new_tokens=12, temperature=1.0, prompt_buckets=16)):
    key = jax.random.key(7)
    batch = generate(model, PROMPTS, config, key=key)
    alone = generate(model, PROMPTS[:1], config, key=key)
    for name in ("tokens", "forwards", "trace"):
      np.testing.assert_array_equal(np.asarray(getattr(batch, name))[:1], np.asarray(getattr(alone, name)))
    other = generate(model, PROMPTS[:1], config, key=jax.random.key(8))
    assert (np.asarray(other.tokens) != np.asarray(alone.tokens)).any(), config.method


def test_top_k_keeps_the_k_most_probable_per_row():
  import jax
  import jax.numpy as jnp
  from d2f_jax.decode.sampling import sampling_keep

  def top_k_keep(logits, k):  # top_p 1: the top-k filter alone
    return sampling_keep(logits, jax.nn.logsumexp(logits, axis=-1, keepdims=True), jnp.float32(1.0), k)
  logits = jnp.asarray([[3.0, 1.0, 2.0, 0.0], [0.0, 5.0, 4.0, 4.0]])
  assert np.asarray(top_k_keep(logits, jnp.int32(2))).tolist() == [[True, False, True, False],
                                                                    [False, True, True, True]]  # a tie at the k-th
  assert np.asarray(top_k_keep(logits, jnp.int32(0))).all()
  per_row = top_k_keep(logits, jnp.asarray([1, 4], jnp.int32)[:, None])
  assert np.asarray(per_row).tolist() == [[True, False, False, False], [True, True, True, True]]
  # Drawn with top_k=2 from a flat distribution: only the two highest logits ever come out.
  many = jnp.broadcast_to(jnp.asarray([0.3, 0.1, 0.2, 0.0]), (4096, 4))
  drawn = jax.random.categorical(jax.random.key(0), jnp.where(top_k_keep(many, jnp.int32(2)), many, -jnp.inf))
  assert set(np.asarray(drawn).tolist()) == {0, 2}


def test_stepwise_and_stream_equal_the_loop():
  model = sharp_model("dream")
  config = BASE.replace(tau_conf=0.5, tau_add=0.25, tau_act=0.5)
  loop = generate(model, PROMPTS, config)
  host = generate_stepwise(model, PROMPTS, config)
  for name in ("tokens", "lengths", "forwards", "trace", "semi_steps"):
    np.testing.assert_array_equal(np.asarray(getattr(host, name)), np.asarray(getattr(loop, name)))
  chunks = list(stream(model, PROMPTS[2], config))
  assert sum((c.ids for c in chunks), []) == loop.to_lists()[2]
  assert chunks[-1].forwards <= int(loop.forwards[2])


def test_config_and_prompt_errors():
  with pytest.raises(ValueError, match="method"):
    DecodeConfig(method="beam")
  with pytest.raises(ValueError, match="multiple of block_size"):
    DecodeConfig(block_size=32, max_new_tokens=100)
  with pytest.raises(ValueError, match="tau_conf"):
    DecodeConfig(tau_conf=1.5)
  with pytest.raises(ValueError, match="top_p"):
    DecodeConfig(top_p=0.0)
  with pytest.raises(ValueError, match="top_k"):
    DecodeConfig(top_k=-1)
  with pytest.raises(ValueError, match="steps"):
    DecodeConfig(method="vanilla", block_size=4, max_new_tokens=16, steps=6)
  with pytest.raises(ValueError, match="block_size"):
    DecodeConfig(block_size=0)
  model = sharp_model("llada")
  with pytest.raises(ValueError, match="prompt 1 is empty"):
    generate(model, [[1], []], BASE)
  with pytest.raises(ValueError, match="outside"):
    generate(model, [[1, 9999]], BASE)
  with pytest.raises(ValueError, match="largest prompt bucket"):
    generate(model, [[1] * 9], BASE.replace(prompt_buckets=(4, 8)))
  with pytest.raises(ValueError, match="vocabulary"):
    generate(model, [[1]], BASE.replace(stop_ids=(600,)))
  with pytest.raises(TypeError, match="graphdef"):
    generate(object(), [[1]], BASE)
