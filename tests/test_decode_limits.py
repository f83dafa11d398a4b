"""A decode request is checked before anything compiles: integer ids inside the vocabulary, rows within the
positions the model was trained for, the KV cache and weights within the memory budget. Each refusal names
the value; the generate CLI prints it as one `error:` line and exits 2."""

import json

import numpy as np
import pytest

from d2f_jax.api import Model
from d2f_jax.decode import DecodeConfig, generate, trace_count
from d2f_jax.decode.limits import DecodeInputError, kv_cache_bytes
from d2f_jax.models import DREAM_7B, LLADA_8B, TINY_DREAM, TINY_LLADA
from model_utils import random_model

CONFIG = DecodeConfig(block_size=4, max_new_tokens=8, prompt_buckets=8)


@pytest.fixture(scope="module")
def model():
  return Model.from_module(random_model(TINY_LLADA, seed=0))


def _refused(model, prompts, config, match):
  before = trace_count("loop")
  with pytest.raises(DecodeInputError, match=match):
    generate(model, prompts, config)
  assert trace_count("loop") == before  # refused before tracing anything


@pytest.mark.parametrize("prompts,match", [
    ([[1, 2.5, 3]], r"prompt 0 holds 2\.5 \(float\)"),
    ([[1, 2], ["7"]], r"prompt 1 holds '7' \(str\)"),
    ([[True, 2]], r"prompt 0 holds True \(bool\)"),
    (np.array([[1.0, 2.0]]), r"prompt_ids has dtype float64"),
    ([[4, 512]], r"prompt 0 has token id 512, outside the vocabulary \[0, 512\)"),
    ([[3], [-5, 4]], r"prompt 1 has token id -5"),
    ([[1], []], r"prompt 1 is empty"),
])
def test_token_ids_must_be_integers_in_the_vocabulary(model, prompts, match):
  _refused(model, prompts, CONFIG, match)


def test_positions_past_the_trained_length_are_refused_up_front(model):
  assert TINY_LLADA.max_positions == 4096 and LLADA_8B.max_positions == 4096 and DREAM_7B.max_positions == 131072
  _refused(model, [[1, 2, 3]], CONFIG.replace(max_new_tokens=2 ** 20),
           r"3 tokens \+ max_new_tokens=1048576 needs 1048579 positions, but the model was trained for 4096")
  _refused(model, [[1] * 4090], CONFIG, r"4090 tokens \+ max_new_tokens=8 needs 4098")
  unbounded = Model(TINY_LLADA.replace(max_positions=None), model.graphdef, model.state)
  result = generate(unbounded, [[1, 2, 3]], CONFIG)  # None: unchecked
  assert result.tokens.shape == (1, 8)


def test_kv_cache_over_the_memory_budget_is_refused(model):
  # [L=2, B=1, 16 positions (bucket 8 + 8 new), K=4, D=16] K and V in fp32 = 16 KiB, plus the weights.
  assert kv_cache_bytes(TINY_LLADA, 1, 16) == 2 * 2 * 16 * 4 * 16 * 4
  _refused(model, [[1, 2, 3]], CONFIG.replace(memory_budget_gib=1e-5),
           r"1 row\(s\) of 16 positions needs a 0\.00 GiB KV cache .* more than memory_budget_gib=1e-05")
  generate(model, [[1, 2, 3]], CONFIG.replace(memory_budget_gib=1.0))  # fits
  # LLaDA-8B at batch 32 and its whole 4096 positions: 64 GiB of bf16 cache, more than one H100.
  assert kv_cache_bytes(LLADA_8B, 32, 4096) / 1024 ** 3 == 64.0
  with pytest.raises(ValueError, match="memory_budget_gib"):
    DecodeConfig(memory_budget_gib=0)


def test_max_positions_round_trips_through_config_json(tmp_path):
  from d2f_jax.convert.hf_config import config_from_hf, hf_config_from_model
  for preset, field in ((TINY_LLADA, "max_sequence_length"), (TINY_DREAM, "max_position_embeddings")):
    hf = hf_config_from_model(preset.replace(max_positions=2048))
    assert hf[field] == 2048
    assert config_from_hf(hf).max_positions == 2048
    del hf[field]
    assert config_from_hf(hf).max_positions is None  # absent: unchecked


def test_generate_cli_refuses_bad_requests_in_one_line(tmp_path, capsys):
  from d2f_jax import generate as cli
  from d2f_jax.convert.synthetic import write_hf_checkpoint
  path = write_hf_checkpoint(tmp_path / "hf", TINY_LLADA, seed=0, dtype="float32")
  assert json.loads((tmp_path / "hf" / "config.json").read_text())["max_sequence_length"] == 4096
  base = ["--model", str(path), "--block_size", "4", "--attention", "xla", "--no_stream"]
  for extra, match in ((["--prompt_ids", "1,,2"], "--prompt_ids must be comma-separated integers, got '1,,2'"),
                       (["--prompt_ids", "1,x"], "--prompt_ids must be comma-separated integers"),
                       (["--prompt_ids", "1,2", "--max_new_tokens", str(2 ** 20)], "trained for 4096"),
                       (["--prompt_ids", "1,600", "--max_new_tokens", "8"], "token id 600")):
    with pytest.raises(SystemExit) as stop:
      cli.main(base + extra)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and match in err[-1], err
  stats = cli.main(base + ["--prompt_ids", "1, 2,3", "--max_new_tokens", "8"])  # spaces are fine
  assert stats["prompt_tokens"] == 3


def test_every_refused_decode_option_is_one_error_line_and_status_2(tmp_path, capsys):
  from d2f_jax import evaluate, generate as cli
  from d2f_jax.convert.synthetic import write_hf_checkpoint
  path = str(write_hf_checkpoint(tmp_path / "hf", TINY_LLADA, seed=0, dtype="float32"))
  for main, argv, match in (
      (cli.main, ["--model", path, "--prompt_ids", "1", "--block_size", "3"], "bad decoding option"),
      (cli.main, ["--model", path, "--prompt_ids", "1", "--stop_ids", "a"], "--stop_ids must be"),
      (cli.main, ["--model", path, "--prompt_ids", "1", "--mesh", "model=2"], "--mesh 'model=2'"),
      (evaluate.main, ["--model", path, "--task", "gsm8k", "--limit", "0"], "--limit must be a positive int"),
      (evaluate.main, ["--model", path, "--task", "arithmetic", "--method", "ar", "--limit", "1"], "does not fit")):
    with pytest.raises(SystemExit) as stop:
      main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and match in str(stop.value), (argv, str(stop.value))
    assert err[-1] == f"error: {stop.value}", err


@pytest.mark.parametrize("changes, field", [
    (dict(method="beam"), "method"), (dict(block_size=0), "block_size"), (dict(max_new_tokens=10), "max_new_tokens"),
    (dict(tau_add=1.5), "tau_add"), (dict(tau_act="high"), "tau_act"), (dict(tau_conf=None), "tau_conf"),
    (dict(temperature=-1.0), "temperature"), (dict(temperature=float("inf")), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p="1"), "top_p"), (dict(top_k=2 ** 31), "top_k"),
    (dict(stop_ids=(True,)), "stop_ids"), (dict(stop_ids=tuple(range(9))), "stop_ids"),
    (dict(query_limit=0), "query_limit"), (dict(method="ar", block_size=1, cache_decided=True), "cache_decided"),
    (dict(prompt_buckets=()), "prompt_buckets")])
def test_a_bad_setting_names_its_field(changes, field):
  """SettingError carries the DecodeConfig field (the server maps it to the client's name in one table)."""
  from d2f_jax.decode.config import SettingError
  with pytest.raises(SettingError) as error:
    CONFIG.replace(**changes)
  assert error.value.field == field and str(error.value).startswith(f"DecodeConfig.{field} "), str(error.value)


def test_host_knobs_are_the_device_knobs_and_check_the_vocabulary():
  """Knobs.on_host is what `resolve` puts on the device (one builder), as numpy; a stop id outside the
  model's vocabulary is refused naming stop_ids."""
  import jax
  from d2f_jax.decode.config import Knobs, SettingError, resolve
  config = CONFIG.replace(tau_add=0.3, temperature=0.5, top_k=7, stop_ids=(5, 9), query_limit=2)
  host = Knobs.on_host(config, TINY_LLADA)
  _, device = resolve(config, TINY_LLADA)
  for name, value in vars(host).items():
    assert isinstance(value, np.generic | np.ndarray), name
    assert isinstance(getattr(device, name), jax.Array)
    np.testing.assert_array_equal(np.asarray(getattr(device, name)), value, err_msg=name)
    assert np.asarray(getattr(device, name)).dtype == value.dtype, name
  assert host.stop_ids.tolist() == [5, 9] + [-1] * 6 and int(host.add_count) == 2  # ceil(0.3 * 4)
  with pytest.raises(SettingError, match=r"outside the vocabulary \[0, 512\)") as error:
    Knobs.on_host(CONFIG.replace(stop_ids=(512,)), TINY_LLADA)
  assert error.value.field == "stop_ids"
