"""LLaDA2 (the BailingMoeV2 mixture-of-experts family): a tiny random checkpoint in the released Hugging Face
format through convert and load, logits against an independent float64 numpy forward of the checkpoint's own
tensors (tests/llada2_reference.py) under the block-diffusion mask, the two expert dispatches against each
other, the router against the reference's, a byte-identical export, and config.json fields that ask for
another model refused by name."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

import d2f_jax
import llada2_reference as ref
from d2f_jax.convert import synthetic
from d2f_jax.convert.hf_config import ConfigError, config_from_hf, hf_config_from_model
from d2f_jax.convert.hf_export import export_hf
from d2f_jax.convert.hf_import import load_hf_params
from d2f_jax.models import forward
from d2f_jax.models.config import LLADA2_FLASH, LLADA2_MINI, TINY_LLADA2
from d2f_jax.models.moe import route

BLOCK = 8  # the tiny model's diffusion block (the released models use 32)
TOL = dict(rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  hf_dir = tmp_path_factory.mktemp("llada2")
  synthetic.write_hf_checkpoint(hf_dir, TINY_LLADA2, seed=3, dtype="float32", tokenizer=False)
  return hf_dir, d2f_jax.load_model(str(hf_dir))


def _tokens(n: int, seed: int = 0) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, TINY_LLADA2.mask_token_id, size=n)


def _logits(model, tokens: np.ndarray, block: int = BLOCK, dispatch: str | None = None) -> np.ndarray:
  positions = jnp.arange(len(tokens), dtype=jnp.int32)[None]
  graphdef = model.graphdef
  if dispatch is not None:  # the same weights computed through the other expert dispatch
    from flax import nnx
    module = nnx.merge(model.graphdef, model.state)
    module.config = module.layers.config = module.moe_layers.config = module.config.replace(
        moe=dataclasses.replace(module.config.moe, dispatch=dispatch))
    graphdef = nnx.split(module)[0]
  logits, _ = forward(graphdef, model.state, jnp.asarray(tokens)[None], positions, positions // block)
  return np.asarray(logits[0])


def test_the_loaded_config_is_the_released_layout(checkpoint):
  _, model = checkpoint
  c = model.config
  assert c.family == "llada2" and c.attention_kind == "block_causal" and c.qk_norm and c.rotary_dim == 8
  assert c.moe == TINY_LLADA2.moe and c.dense_layers == 1


def test_logits_match_the_independent_reference(checkpoint):
  """Within 1e-4 in float32 against the float64 reference; a wrong mask (bidirectional) is far off."""
  hf_dir, model = checkpoint
  tokens = _tokens(21)
  expected = ref.logits(str(hf_dir), tokens, BLOCK)
  got = _logits(model, tokens)
  np.testing.assert_allclose(got, expected, **TOL)
  assert np.abs(_logits(model, tokens, block=64) - expected).max() > 1e-2  # one block: everything visible


def test_dense_and_ragged_experts_agree(checkpoint):
  _, model = checkpoint
  tokens = _tokens(19, seed=1)
  ragged, dense = _logits(model, tokens, dispatch="ragged"), _logits(model, tokens, dispatch="dense")
  np.testing.assert_allclose(ragged, dense, rtol=1e-5, atol=1e-5)


def test_the_router_chooses_and_weighs_as_the_released_gate(checkpoint):
  """Experts (as sets) and weights of the kept groups' top experts, against the reference gate."""
  hf_dir, model = checkpoint
  config, tensors = ref.load(str(hf_dir))
  x = np.random.default_rng(2).standard_normal((64, TINY_LLADA2.embed_dim))
  want_experts, want_weights = ref.route(x, tensors, "model.layers.1.mlp", config)
  w = {k: v[0] for k, v in model.state["moe_layers"].items() if k in ("router", "expert_bias")}
  experts, weights = route(jnp.asarray(x, jnp.float32), w["router"][...], w["expert_bias"][...], model.config.moe)
  order = np.argsort(np.asarray(experts), axis=1)
  want_order = np.argsort(want_experts, axis=1)
  np.testing.assert_array_equal(np.take_along_axis(np.asarray(experts), order, 1),
                                np.take_along_axis(want_experts, want_order, 1))
  np.testing.assert_allclose(np.take_along_axis(np.asarray(weights), order, 1),
                             np.take_along_axis(want_weights, want_order, 1), rtol=1e-5)
  groups = np.asarray(experts) // (TINY_LLADA2.moe.num_experts // TINY_LLADA2.moe.num_groups)
  assert (groups == groups[:, :1]).all()  # one group kept of two: every choice inside it
  assert len(np.unique(groups[:, 0])) == 2  # and both groups get chosen by some token


def test_export_writes_the_same_tensors_and_config(checkpoint, tmp_path):
  hf_dir, _ = checkpoint
  config, params = load_hf_params(str(hf_dir), progress=False)
  export_hf(tmp_path / "out", config, params, progress=False)
  before, after = load_file(str(hf_dir / "model.safetensors")), load_file(str(tmp_path / "out/model.safetensors"))
  assert sorted(before) == sorted(after)
  for name in before:
    np.testing.assert_array_equal(after[name], before[name], err_msg=name)
  assert config_from_hf(json.loads((tmp_path / "out/config.json").read_text())) == config


@pytest.mark.parametrize("preset", [LLADA2_MINI, LLADA2_FLASH])
def test_the_released_sizes_round_trip_through_config_json(preset):
  assert config_from_hf(hf_config_from_model(preset)) == preset
  counts = {"llada2-mini": 16.26e9, "llada2-flash": 102.9e9}
  from d2f_jax.convert.mapping import param_shapes
  total = sum(np.prod(s) for s in param_shapes(preset).values())
  name = "llada2-mini" if preset is LLADA2_MINI else "llada2-flash"
  assert abs(total - counts[name]) / counts[name] < 0.01, total


@pytest.mark.parametrize("field, value", [("score_function", "softmax"), ("moe_router_enable_expert_bias", False),
                                          ("norm_topk_prob", False), ("norm_head", True), ("use_bias", True),
                                          ("rope_scaling", {"type": "yarn"}), ("hidden_act", "gelu"),
                                          ("n_group", 3), ("partial_rotary_factor", 0.1)])
def test_a_config_asking_for_another_model_is_refused_by_name(field, value):
  raw = {**hf_config_from_model(TINY_LLADA2), field: value}
  with pytest.raises(ConfigError) as error:
    config_from_hf(raw, source="ck/config.json")
  assert "ck/config.json" in str(error.value) and (field in str(error.value) or "experts" in str(error.value))


def test_a_jitted_forward_compiles_once_for_both_stacks(checkpoint):
  """Both stacks run inside one jitted forward, scanned (no cache) and unrolled (layer_loop='unroll')."""
  _, model = checkpoint
  tokens = _tokens(16, seed=4)
  scanned = _logits(model, tokens)
  from flax import nnx
  module = nnx.merge(model.graphdef, model.state)
  module.config = module.layers.config = module.moe_layers.config = module.config.replace(layer_loop="unroll")
  positions = jnp.arange(16, dtype=jnp.int32)[None]
  unrolled, _ = jax.jit(lambda t: module(t, positions, positions // BLOCK))(jnp.asarray(tokens)[None])
  np.testing.assert_allclose(np.asarray(unrolled[0]), scanned, rtol=1e-5, atol=1e-5)


def test_peft_adapters_are_refused_with_the_reason(tmp_path):
  """PEFT's LoRA names Linear modules; LLaDA2's q / k / v are one fused Linear: refused, not misplaced."""
  from d2f_jax.convert.lora import AdapterError, export_peft_adapter, read_adapter_config
  from d2f_jax.models.config import LoraConfig
  with pytest.raises(AdapterError, match="fused"):
    read_adapter_config(str(tmp_path), "llada2")
  with pytest.raises(AdapterError, match="query_key_value"):
    export_peft_adapter(tmp_path / "out", TINY_LLADA2, LoraConfig(rank=2), {})


@pytest.fixture(scope="module")
def sharp():
  """A random tiny LLaDA2 (block-causal) with a 4x head, so confidences spread over (0, 1) as a trained one's."""
  from d2f_jax.api import Model
  from model_utils import random_model
  module = random_model(TINY_LLADA2.replace(attention_kind="block_causal"), seed=0)
  module.lm_head[...] = module.lm_head[...] * 4.0
  return Model.from_module(module)


PROMPTS = [[11, 23, 5, 101, 7], [3, 14, 15, 92, 65, 35, 89, 79, 32]]


@pytest.mark.parametrize("thresholds", [(0.9, 0.1, 0.95), (0.3, 0.0, 0.75)])
def test_d2f_decodes_llada2_as_the_plain_reference(sharp, thresholds):
  """The pipelined decoder (KV cache across both stacks, batched, compiled) on the MoE model: the plain
  step-by-step reference's tokens, forwards and acceptance trace, row by row."""
  from d2f_jax.decode import DecodeConfig, generate
  from test_decode import assert_rows_match, d2f_reference
  tau_conf, tau_add, tau_act = thresholds
  config = DecodeConfig(block_size=4, max_new_tokens=16, max_blocks_in_flight=3, prompt_buckets=16,
                        tau_conf=tau_conf, tau_add=tau_add, tau_act=tau_act)
  expected = [d2f_reference(sharp, p, config) for p in PROMPTS]
  assert_rows_match(generate(sharp, PROMPTS, config), expected, PROMPTS)


def test_the_engine_serves_llada2_requests_as_alone(sharp):
  from d2f_jax.decode import DecodeConfig, generate
  from d2f_jax.serve import Engine, EngineConfig, RequestSettings
  engine = Engine(sharp, EngineConfig(slots=2, block_size=4, max_new_tokens=12, max_prompt_len=12, prompt_bucket=8,
                                      steps_per_call=2))
  settings = [RequestSettings(), RequestSettings(tau_conf=0.5, tau_add=0.25, tau_act=0.5), RequestSettings()]
  prompts = PROMPTS + [[99, 98]]
  results = engine.complete(prompts, settings)
  for prompt, s, got in zip(prompts, settings, results):
    config = DecodeConfig(block_size=4, max_new_tokens=12, prompt_buckets=8, tau_conf=s.tau_conf, tau_add=s.tau_add,
                          tau_act=s.tau_act)
    alone = generate(sharp, [prompt], config)
    assert got.tokens == np.asarray(alone.tokens[0, :int(alone.lengths[0])]).tolist(), prompt
    assert got.forwards == int(alone.forwards[0]), prompt


def test_distillation_trains_lora_on_both_stacks_and_leaves_the_experts(tmp_path):
  """Two distillation steps of the tiny recipe on LLaDA2: the adapters on the attention of the dense and of
  the expert layers move; nothing of the router, its bias or the experts is trainable (frozen base); the
  router's load is logged."""
  from test_robust_train import tiny_config
  from d2f_jax.train.trainer import Trainer
  config = tiny_config(total_steps=2)
  config.model.preset = "tiny-llada2"
  trainer = Trainer(config, str(tmp_path))
  history = trainer.run(num_steps=2)
  assert [h["step"] for h in history if "loss" in h] == [1, 2]
  # The teacher sees the rows bidirectionally: with its own block-causal view (the student's), the student,
  # starting as the teacher (B = 0), would be at KL 0 with no gradient.
  assert history[0]["step"] == 0 and history[0]["eval_kl"] > 1e-4, history[0]
  assert all(np.isfinite(h["loss"]) for h in history if "loss" in h)
  steps = [h for h in history if "loss" in h]  # the router's load is logged every step
  assert all(1.0 <= h["router_max_load"] <= TINY_LLADA2.moe.num_experts and 0.0 <= h["router_unused"] < 1.0
             for h in steps), steps
  leaves = jax.tree_util.tree_leaves_with_path(trainer.state.params)
  trained = {jax.tree_util.keystr(k): np.asarray(v) for k, v in leaves}
  for stack in ("layers", "moe_layers"):
    b = trained.get(f"['{stack}']['q_lora_b']")
    assert b is not None and np.abs(b).max() > 0, (stack, sorted(trained))  # B starts at zero: it was trained
  assert not [k for k in trained if any(n in k for n in ("router", "expert", "shared"))], sorted(trained)
  # PEFT cannot name LLaDA2's fused q / k / v: the student exports as a whole checkpoint, LoRA merged in, whose
  # logits are the trained student's (the merge is W + scale a b in float32).
  out = trainer.export()
  assert os.path.basename(out) == "hf" and not os.path.exists(tmp_path / "adapter")
  from flax import nnx
  graphdef, state = nnx.split(trainer.model())
  tokens = jnp.asarray(_tokens(21))[None]
  positions = jnp.arange(21, dtype=jnp.int32)[None]
  want, _ = forward(graphdef, state, tokens, positions, positions // BLOCK)
  exported = d2f_jax.load_model(out)
  assert exported.config.family == "llada2" and exported.config.moe == trainer.models.config.moe
  np.testing.assert_allclose(_logits(exported, np.asarray(tokens[0])), np.asarray(want[0]), rtol=1e-4, atol=1e-4)
  trainer.close()


@pytest.mark.parametrize("steps, tau_conf, stops", [(4, 0.9, ()), (2, 0.5, ()), (4, 0.3, None)])
def test_llada2s_own_sampler_matches_its_released_loop(sharp, steps, tau_conf, stops):
  """method='llada2' (batched, jitted) against a plain transcription of the released generate, row by row:
  prompts ending inside a block (its prompt part fixed) and on a block boundary; the default stop ids end a
  row after the block holding one."""
  import decode_reference
  from d2f_jax.decode import DecodeConfig, generate
  prompts = PROMPTS + [[5, 6, 7, 8, 9, 10, 11, 12]]
  config = DecodeConfig(method="llada2", block_size=4, max_new_tokens=16, steps=steps, tau_conf=tau_conf,
                        prompt_buckets=16, stop_ids=stops)
  stop_ids = set(stops) if stops is not None else {sharp.config.eos_token_id}
  result = generate(sharp, prompts, config)
  for row, prompt in enumerate(prompts):
    want = decode_reference.llada2_block(sharp, prompt, block_size=4, max_new_tokens=16, steps=steps,
                                         threshold=tau_conf, stop_ids=stop_ids)
    where = f"row {row} (prompt of {len(prompt)})"
    np.testing.assert_array_equal(np.asarray(result.tokens[row]), want["tokens"], err_msg=where)
    assert int(result.lengths[row]) == want["length"] and int(result.forwards[row]) == want["forwards"], where
    np.testing.assert_array_equal(np.asarray(result.trace[row]), want["trace"], err_msg=where)


EDITING_CASES = [(0.7, 0.5, 16, ()), (0.5, 0.0, 3, None), (0.9, 0.5, 0, ())]  # (tau_conf, editing, post, stops)


def test_llada21s_token_editing_matches_its_released_loop(sharp):
  """method='llada2' with editing_threshold (LLaDA2.1's loop: one mask at least a step, decided tokens of the
  block rewritten above the editing threshold, post-fill forwards up to max_post_steps) against a plain
  transcription of it, row by row, for the model card's quality mode (16 post steps), its speed mode (capped
  at 3: a random model's choices flip back and forth) and no post step; the cases together rewrite tokens,
  so the editing path is exercised, and with editing off the same settings give other tokens."""
  import decode_reference
  from d2f_jax.decode import DecodeConfig, generate
  prompts = PROMPTS + [[5, 6, 7, 8, 9, 10, 11, 12]]
  rewrites, differs = 0, False
  for tau_conf, editing, post, stops in EDITING_CASES:
    config = DecodeConfig(method="llada2", block_size=4, max_new_tokens=12, tau_conf=tau_conf, prompt_buckets=16,
                          stop_ids=stops, editing_threshold=editing, max_post_steps=post)
    stop_ids = set(stops) if stops is not None else {sharp.config.eos_token_id}
    result = generate(sharp, prompts, config)
    plain = generate(sharp, prompts, config.replace(editing_threshold=None, steps=4))
    for row, prompt in enumerate(prompts):
      want = decode_reference.llada21_editing(sharp, prompt, block_size=4, max_new_tokens=12, threshold=tau_conf,
                                              editing_threshold=editing, max_post_steps=post, stop_ids=stop_ids)
      where = f"case {(tau_conf, editing, post, stops)} row {row} (prompt of {len(prompt)})"
      np.testing.assert_array_equal(np.asarray(result.tokens[row]), want["tokens"], err_msg=where)
      assert int(result.lengths[row]) == want["length"] and int(result.forwards[row]) == want["forwards"], where
      np.testing.assert_array_equal(np.asarray(result.trace[row]), want["trace"], err_msg=where)
      rewrites += want["rewrites"]
    differs |= not np.array_equal(np.asarray(result.tokens), np.asarray(plain.tokens))
  assert rewrites > 0 and differs, (rewrites, differs)


def test_a_stream_with_editing_emits_only_tokens_no_edit_can_change(sharp):
  """Streaming (runner.stream, the generate CLI's default) with editing sends a block's tokens once the block
  is over, so the chunks add up to the final answer even where later steps rewrote tokens."""
  from d2f_jax.decode import DecodeConfig, generate
  from d2f_jax.decode.runner import stream
  config = DecodeConfig(method="llada2", block_size=4, max_new_tokens=12, tau_conf=0.5, prompt_buckets=16,
                        editing_threshold=0.0, max_post_steps=3, stop_ids=())
  for prompt in PROMPTS:
    alone = generate(sharp, [prompt], config)
    streamed = [t for chunk in stream(sharp, prompt, config) for t in chunk.ids]
    assert streamed == np.asarray(alone.tokens[0, :int(alone.lengths[0])]).tolist(), prompt


def test_editing_settings_are_refused_by_name():
  from d2f_jax.decode import DecodeConfig
  from d2f_jax.decode.config import SettingError
  for kw, field in ((dict(editing_threshold=0.5), "editing_threshold"),
                    (dict(method="llada2", editing_threshold=1.5), "editing_threshold"),
                    (dict(method="llada2", max_post_steps=-1), "max_post_steps")):
    with pytest.raises(SettingError, match=field) as error:
      DecodeConfig(**kw)
    assert error.value.field == field


def test_the_openai_server_serves_a_llada2_checkpoint(tmp_path):
  """The real server process on a tiny LLaDA2 checkpoint (released format, with tokenizer), driven by the
  official openai client: completions and streams equal batch-one generate."""
  from safetensors.numpy import save_file
  from test_serve_server import Server
  checkpoint = tmp_path / "tiny_llada2"
  synthetic.write_hf_checkpoint(checkpoint, TINY_LLADA2, seed=0, dtype="float32")
  weights = load_file(str(checkpoint / "model.safetensors"))
  weights["lm_head.weight"] = weights["lm_head.weight"] * 4.0  # clear greedy choices
  save_file(weights, str(checkpoint / "model.safetensors"), metadata={"format": "pt"})
  server = Server(checkpoint, tmp_path / "server.log")
  try:
    prompts = ["w5 w7 w9", "w11 w13 w17 w19 w23"]
    model = d2f_jax.load_model(str(checkpoint))
    texts = model.generate(prompts, prompt_buckets=32, block_size=4, max_new_tokens=16)
    assert all(texts), texts
    server.wait_ready()
    for prompt, text in zip(prompts, texts):
      got = server.client.completions.create(model="tiny", prompt=prompt, max_tokens=16)
      assert got.choices[0].text == text, prompt
    chunks = list(server.client.completions.create(model="tiny", prompt=prompts[1], stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == texts[1]
  finally:
    server.stop()


_SHARDED_CHILD = """
import dataclasses, json
import jax, numpy as np
jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_disable_most_optimizations", True)
from d2f_jax.api import Model
from d2f_jax.decode import DecodeConfig, generate
from d2f_jax.models.config import TINY_LLADA2
from d2f_jax.sharding import make_mesh
from model_utils import random_model
assert jax.device_count() == 4, jax.devices()
model = Model.from_module(random_model(TINY_LLADA2.replace(attention_kind="block_causal"), seed=0))
prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13]]
out = {}
for method, cached in (("d2f", False), ("llada2", False), ("llada2", True)):
  config = DecodeConfig(method=method, block_size=4, max_new_tokens=16, tau_conf=0.05, prompt_buckets=8,
                        block_cache=cached)
  host = lambda r: {k: np.asarray(v).tolist() for k, v in dataclasses.asdict(r).items()}
  ref = host(jax.block_until_ready(generate(model, prompts, config)))
  for name, sizes in (("t4", dict(tensor=4)), ("d2t2", dict(data=2, tensor=2))):
    sharded = model.shard(make_mesh(sizes, jax.devices()))
    got = host(jax.block_until_ready(generate(sharded, prompts, config)))
    spec = sharded.state["moe_layers"]["expert_gate"][...].sharding.spec
    out[f"{method}{'-cached' if cached else ''}-{name}"] = {
        "diff": sorted(k for k in ref if ref[k] != got[k]), "lengths": got["lengths"],
        "expert_spec": [str(e) for e in spec]}
print("RESULT" + json.dumps(out))
"""


def test_sharded_decode_splits_the_experts_and_equals_one_device():
  """On 4 fake CPU devices the experts are split over the tensor axis ('expert' rule: 2 of 8 per device)
  and d2f / llada2 decoding (and llada2's block_cache) is token-identical to one device (tensor 4, and data 2 x
  tensor 2)."""
  import os
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu",
         "TF_CPP_MIN_LOG_LEVEL": "3",
         "PYTHONPATH": os.pathsep.join([root, os.path.join(root, "tests"), os.environ.get("PYTHONPATH", "")])}
  proc = subprocess.run([sys.executable, "-c", _SHARDED_CHILD], env=env, capture_output=True, text=True,
                        timeout=540, cwd=root)
  assert proc.returncode == 0, proc.stderr[-4000:]
  runs = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))[len("RESULT"):])
  assert len(runs) == 6, sorted(runs)
  for name, r in runs.items():
    assert r["diff"] == [] and all(n > 0 for n in r["lengths"]), (name, r)
    assert r["expert_spec"][:2] == ["None", "tensor"], (name, r["expert_spec"])  # [L, X, E, F]: X split


def test_router_metrics_summarise_the_load():
  from d2f_jax.train.router_stats import router_metrics
  load = jnp.asarray([[3.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])  # [L, X]: a skewed layer and an even one
  got = {k: float(v) for k, v in router_metrics({"expert_load": load}).items()}
  assert got == pytest.approx({"router_max_load": (0.75 * 4 + 0.25 * 4) / 2, "router_unused": 2 / 8})
  assert router_metrics({"ce": 1.0}) == {}


def test_the_prompt_attends_in_blocks_from_position_0():
  """LLaDA2 was trained block-causally from position 0, so with ModelConfig.prompt_blocks its prompt is cut
  in blocks too (ids numbered up to -1) while the response blocks still start at the prompt's end."""
  from d2f_jax.models import attention_ids
  positions = jnp.arange(14)[None]
  got = attention_ids(positions, "block_causal", prompt_len=9, block_size=4, prompt_blocks=True)
  assert got[0].tolist() == [-3] * 4 + [-2] * 4 + [-1] + [0] * 4 + [1]
  plain = attention_ids(positions, "block_causal", prompt_len=9, block_size=4)
  assert plain[0].tolist() == [-1] * 9 + [0] * 4 + [1]
  assert TINY_LLADA2.prompt_blocks and LLADA2_MINI.prompt_blocks


def test_d2f_on_llada2_decodes_with_its_prompt_blocks(sharp):
  """The decoder honours prompt_blocks: a 9-token prompt (3 blocks of 4) decodes otherwise with the prompt
  one bidirectional unit (the plain reference follows the config either way: see the test above it)."""
  from d2f_jax.api import Model
  from d2f_jax.decode import DecodeConfig, generate
  from flax import nnx
  config = DecodeConfig(block_size=4, max_new_tokens=16, prompt_buckets=16, tau_conf=0.5, tau_add=0.25, tau_act=0.5)
  module = nnx.merge(sharp.graphdef, sharp.state)
  flat = module.config.replace(prompt_blocks=False)
  module.config = module.layers.config = module.moe_layers.config = flat
  unit = Model.from_module(module)
  prompts = [PROMPTS[1] * 2]
  assert np.asarray(generate(sharp, prompts, config).tokens).tolist() != \
      np.asarray(generate(unit, prompts, config).tokens).tolist()


def test_a_merged_export_covers_the_stacks_each_target_exists_in_and_refuses_many_processes(tmp_path, monkeypatch,
                                                                                            caplog):
  """LoRA on an MLP target adapts the dense layers only (the expert stack has no such projection): the merge
  folds each adapter into its own stack. A multi-process run does not gather the whole base to merge it: it
  says how to export on one host instead."""
  from flax import nnx
  from d2f_jax import convert
  from d2f_jax.models import LoraConfig, Transformer
  from d2f_jax.train import model as train_model
  lora = LoraConfig(rank=2, alpha=4.0, targets=("q", "gate"))
  module = Transformer(TINY_LLADA2, lora, rngs=nnx.Rngs(0))
  base = nnx.to_pure_dict(nnx.state(module, nnx.Param))
  adapter = jax.tree.map(lambda x: np.asarray(x) + 0.1, nnx.to_pure_dict(nnx.state(module, nnx.LoRAParam)))
  assert "gate_lora_a" in adapter["layers"] and "gate_lora_a" not in adapter["moe_layers"]
  base = jax.tree.map(np.asarray, base)
  merged = convert.merge_lora(base, lora, adapter, TINY_LLADA2)
  for stack, target in (("layers", "q"), ("layers", "gate"), ("moe_layers", "q")):
    assert np.abs(merged[stack][target] - base[stack][target]).max() > 1e-3, (stack, target)
  np.testing.assert_array_equal(merged["moe_layers"]["expert_gate"], base["moe_layers"]["expert_gate"])
  models = train_model.TrainModels.create(TINY_LLADA2, lora, teacher=True)
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  with caplog.at_level("WARNING", logger="d2f_jax.train.model"):
    assert train_model.export_student(str(tmp_path / "hf"), models, adapter, frozen=base) is None
  assert "not exported" in caplog.text and "2 processes" in caplog.text and "':cpu' hardware preset" in caplog.text
  assert not os.path.exists(tmp_path / "hf")
