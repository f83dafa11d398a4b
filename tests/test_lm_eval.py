"""The lm-evaluation-harness adapter end to end on a tiny model and the data directory ($D2F_DATA_DIR, here
the project's own GSM8K / HumanEval-format files of tests/fixtures/data): the documented command runs, its results JSON is lm-eval's, and it agrees with the built-in harness problem by
problem under the same prompts and extraction. Offline: no hub access is attempted."""

import glob
import json
import os
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402

from d2f_jax.evals import gsm8k  # noqa: E402
from d2f_jax.models import TINY_LLADA  # noqa: E402

pytest.importorskip("lm_eval")

REPO = Path(__file__).resolve().parents[1]
TASKS_DIR = REPO / "d2f_jax" / "evals" / "lm_eval_tasks"
LIMIT, NEW_TOKENS = 3, 16
DECODE_ARGS = "method=d2f,block_size=8,prompt_buckets=256"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  from d2f_jax.convert.synthetic import write_hf_checkpoint
  return write_hf_checkpoint(tmp_path_factory.mktemp("tiny_llada_lm_eval"), TINY_LLADA, seed=0, dtype="float32")


@pytest.fixture(scope="module")
def model(checkpoint):
  import d2f_jax
  return d2f_jax.load_model(checkpoint)


@pytest.fixture
def elsewhere(monkeypatch, tmp_path, fixture_data_dir):
  monkeypatch.chdir(tmp_path)  # the task configs work from any directory
  monkeypatch.setenv("D2F_DATA_DIR", str(fixture_data_dir))  # and read the data directory


@pytest.fixture(scope="module")
def cli_run(checkpoint, tmp_path_factory, fixture_data_dir):
  """The documented command (in process), on the built-in protocol's task config."""
  from d2f_jax.evals.lm_eval_model import main
  out = tmp_path_factory.mktemp("lm_eval_out")
  with pytest.MonkeyPatch.context() as patch:
    patch.chdir(out)  # any directory: the task configs read the data directory, not a relative path
    patch.setenv("D2F_DATA_DIR", str(fixture_data_dir))
    main(["--model", "d2f_jax", "--model_args", f"pretrained={checkpoint},{DECODE_ARGS}", "--tasks", "gsm8k_builtin",
          "--include_path", str(TASKS_DIR), "--limit", str(LIMIT), "--gen_kwargs", f"max_gen_toks={NEW_TOKENS}",
          "--output_path", str(out), "--log_samples"])
  results = json.loads(Path(glob.glob(f"{out}/**/results_*.json", recursive=True)[0]).read_text())
  samples_file = glob.glob(f"{out}/**/samples_gsm8k_builtin_*.jsonl", recursive=True)[0]
  samples = sorted((json.loads(line) for line in open(samples_file)), key=lambda s: s["doc_id"])
  return results, samples


def _task_manager():
  from lm_eval.tasks import TaskManager
  return TaskManager(include_path=str(TASKS_DIR), include_defaults=False)


def test_results_json_is_lm_evals(cli_run):
  results, samples = cli_run
  assert {"results", "configs", "versions", "n-shot", "config", "lm_eval_version"} <= set(results)
  assert results["config"]["model"] == "d2f_jax"
  scores = results["results"]["gsm8k_builtin"]
  assert {"exact_match,none", "exact_match_stderr,none"} <= set(scores)
  assert results["n-shot"]["gsm8k_builtin"] == 4 and len(samples) == LIMIT


def test_adapter_agrees_with_the_builtin_harness_problem_by_problem(cli_run, model, elsewhere, tmp_path):
  from d2f_jax.decode import DecodeConfig
  from d2f_jax.evals import gsm8k
  from d2f_jax.evals.runner import run_benchmark

  results, samples = cli_run
  task = gsm8k.Gsm8kTask()
  config = DecodeConfig(method="d2f", block_size=8, max_new_tokens=NEW_TOKENS, prompt_buckets=256)
  builtin = run_benchmark(model, task, config, limit=LIMIT, batch_size=1, warmup="none", log=None,
                          out_dir=str(tmp_path))
  builtin_samples = [json.loads(line) for line in open(tmp_path / "samples.jsonl")]
  contexts = [s["arguments"]["gen_args_0"]["arg_0"] for s in samples]
  assert contexts == [item["prompt"] for item in task.load(LIMIT)]  # the same prompts, character for character
  until = samples[0]["arguments"]["gen_args_0"]["arg_1"]["until"]
  assert tuple(until) == gsm8k.STOP_STRINGS
  for sample, mine in zip(samples, builtin_samples, strict=True):
    response = sample["filtered_resps"][0]
    assert gsm8k.truncate(response) == mine["kept"]  # the same generation
    assert gsm8k.extract_answer(gsm8k.truncate(response)) == mine["extracted"]
    assert sample["exact_match"] == float(mine["correct"])
  assert results["results"]["gsm8k_builtin"]["exact_match,none"] == pytest.approx(builtin["score"] / 100)


def test_paper_protocol_chat_template_multiturn_and_bos(model, elsewhere):
  import lm_eval

  from d2f_jax.evals.lm_eval_model import D2FJaxLM
  lm = D2FJaxLM(model=model, add_bos=True, block_size=8, prompt_buckets=256)
  out = lm_eval.simple_evaluate(model=lm, tasks=["gsm8k_d2f"], task_manager=_task_manager(), limit=1,
                                apply_chat_template=True, fewshot_as_multiturn=True, gen_kwargs="max_gen_toks=8",
                                bootstrap_iters=0)
  context = out["samples"]["gsm8k_d2f"][0]["arguments"][0][0]  # in memory: [(context, gen_kwargs)]
  assert context.count("Question:") == 5 and context.count("user ") == 5 and context.count("assistant ") == 5
  ids, seen = lm.requests_seen[-1]
  assert ids[0] == model.config.bos_token_id and ids.count(model.config.bos_token_id) == 1
  assert seen["limit"] == 8 and seen["max_new_tokens"] == 8
  task = _task_manager().load("gsm8k_d2f")["tasks"]["gsm8k_d2f"]
  assert task.config.num_fewshot == 4 and task.config.generation_kwargs["max_gen_toks"] == 512
  assert task.config.generation_kwargs["until"] == ["Question:", "</s>", "<|im_end|>"]


def test_humaneval_task_is_judged_in_the_sandbox(model, elsewhere, monkeypatch):
  import lm_eval

  from d2f_jax.evals.lm_eval_model import D2FJaxLM
  from d2f_jax.evals.lm_eval_tasks import d2f_tasks
  from d2f_jax.evals.humaneval import load_problems
  from d2f_jax.evals.sandbox import bubblewrap_unavailable_reason
  if bubblewrap_unavailable_reason() is not None:
    monkeypatch.setenv("D2F_SANDBOX_ISOLATION", "process")
  d2f_tasks._sandbox.cache_clear()
  problem = load_problems(limit=1)[0]
  assert d2f_tasks.humaneval_results(problem, [problem["canonical_solution"]]) == {"pass@1": 1.0}
  assert d2f_tasks.humaneval_results(problem, ["    import os; os._exit(0)\n"]) == {"pass@1": 0.0}
  lm = D2FJaxLM(model=model, block_size=8, prompt_buckets=256)
  out = lm_eval.simple_evaluate(model=lm, tasks=["humaneval_d2f"], task_manager=_task_manager(), limit=2,
                                gen_kwargs="max_gen_toks=8", bootstrap_iters=0)
  assert out["results"]["humaneval_d2f"]["pass@1,none"] == 0.0  # random tiny weights write no working code
  assert [s["doc"]["task_id"] for s in out["samples"]["humaneval_d2f"]] == ["Fixture/0", "Fixture/1"]


class _Request:
  def __init__(self, context, gen_kwargs):
    self.args = (context, gen_kwargs)


def test_generate_until_honours_until_and_max_gen_toks(model, capsys):
  from d2f_jax.evals.lm_eval_model import D2FJaxLM
  lm = D2FJaxLM(model=model, block_size=8, prompt_buckets=256, max_gen_toks=16)
  free, short = lm.generate_until([_Request("w5 w6 w7", {"until": []}), _Request("w5 w6 w7", {"max_gen_toks": 3})])
  err = capsys.readouterr().err  # a progress bar on stderr: hours at GSM8K scale are not silent
  assert "generate_until" in err and "2/2" in err, err
  words = free.split()
  assert 3 < len(words) <= 16 and short.split() == words[:3]
  cut = lm.generate_until([_Request("w5 w6 w7", {"until": [f" {words[2]}"]})], disable_tqdm=True)[0]
  assert "generate_until" not in capsys.readouterr().err  # lm-eval's disable_tqdm turns the bar off
  assert cut == free[:free.find(f" {words[2]}")] and len(cut) < len(free)


def test_mesh_argument_decodes_on_a_mesh_with_the_same_text(model):
  from d2f_jax.evals.lm_eval_model import D2FJaxLM
  plain = D2FJaxLM(model=model, block_size=8, prompt_buckets=256, max_gen_toks=8)
  meshed = D2FJaxLM(model=model, mesh="data=1;tensor=1", block_size=8, prompt_buckets=256, max_gen_toks=8)
  assert meshed.model.placement is not None and dict(meshed.mesh.shape)["tensor"] == 1
  request = [_Request("w5 w6", {"until": []})]
  assert meshed.generate_until(request) == plain.generate_until(request)


def test_loglikelihood_is_the_exact_value_for_one_token_and_a_bound_otherwise(model):
  """One masked token: the ELBO is exactly log p(token | context); checked against the model's own logits."""
  import jax
  import numpy as np

  from d2f_jax.evals.lm_eval_model import D2FJaxLM
  lm = D2FJaxLM(model=model, block_size=8, mc_samples=8)
  context = [int(t) for t in model.encode("w5 w6 w7")]
  row = np.asarray([context + [model.config.mask_token_id]])
  logp = np.asarray(jax.nn.log_softmax(model.logits(row, mode="bidirectional")[0, -1]))  # [V]
  best, other = int(logp.argmax()), int(np.argsort(logp)[len(logp) // 2])
  (value, greedy), (value2, greedy2) = lm.loglikelihood([_Request("w5 w6 w7", f" w{best}"),
                                                         _Request("w5 w6 w7", f" w{other}")])
  assert value == pytest.approx(float(logp[best]), abs=1e-5) and greedy
  assert value2 == pytest.approx(float(logp[other]), abs=1e-5) and not greedy2
  longer = lm.loglikelihood([_Request("w5 w6 w7", " w9 w10 w11")] * 2)
  assert longer[0] == longer[1] and longer[0][0] < 0  # seeded by the request's text: reproducible
  rolling = lm.loglikelihood_rolling([_Request("w5 w6 w7 w8", None)])
  assert len(rolling) == 1 and np.isfinite(rolling[0]) and rolling[0] < 0


def test_elbo_estimate_matches_its_exact_expectation_for_two_tokens(model):
  """For L = 2 the expectation has three terms (l = 1 at either position with weight 2, l = 2 with weight
  1), each from one forward; 64 draws must land within 0.15 nats (about 5 sigma of this estimator here)."""
  import jax
  import numpy as np

  from d2f_jax.evals.lm_eval_elbo import masked_elbo
  prefix, (x0, x1), mask = [int(t) for t in model.encode("w5 w6 w7")], (9, 10), model.config.mask_token_id
  n = len(prefix)

  def logp(row, position, token):
    logits = model.logits(np.asarray([prefix + row]), mode="bidirectional")[0, n + position]
    return float(jax.nn.log_softmax(logits)[token])

  one_masked = 0.5 * 2 * logp([mask, x1], 0, x0) + 0.5 * 2 * logp([x0, mask], 1, x1)
  both_masked = logp([mask, mask], 0, x0) + logp([mask, mask], 1, x1)
  exact = 0.5 * one_masked + 0.5 * both_masked
  estimate, _ = masked_elbo(model, prefix, [x0, x1], samples=64, seed=1)
  assert estimate == pytest.approx(exact, abs=0.15)
  assert masked_elbo(model, prefix, [x0, x1], samples=64, seed=1)[0] == estimate  # seeded


def test_bad_model_args_are_named(model):
  from d2f_jax.evals.lm_eval_model import D2FJaxLM, cut_at_stops
  with pytest.raises(ValueError, match="unknown option.*tau_foo"):
    D2FJaxLM(model=model, tau_foo=1)
  with pytest.raises(ValueError, match="exactly one of pretrained"):
    D2FJaxLM()
  assert cut_at_stops("a\nQuestion: b", ["Question:", "zz"]) == "a\n" and cut_at_stops("abc", []) == "abc"


def test_generate_until_at_batch_above_one_goes_through_the_engine_with_batch_one_text(model):
  """batch_size 3 feeds the requests through a 3-slot engine: each continuation is the batch-1 one (a 4x head
  keeps the random model's greedy choices clear of near-ties)."""
  from d2f_jax.api import Model
  from d2f_jax.evals.lm_eval_model import D2FJaxLM
  module = model.module
  module.lm_head[...] = module.lm_head[...] * 4.0
  model = Model.from_module(module, model.tokenizer)
  requests = [_Request(context, {"until": [], "max_gen_toks": 8}) for context in
              ("w5 w6 w7", "w9 w10", "w11 w12 w13 w14", "w5 w20", "w3")]
  one = D2FJaxLM(model=model, block_size=8, prompt_buckets=256, batch_size=1, tau_conf=0.5)
  three = D2FJaxLM(model=model, block_size=8, prompt_buckets=256, batch_size=3, tau_conf=0.5)
  texts = three.generate_until(requests, disable_tqdm=True)
  assert texts == one.generate_until(requests, disable_tqdm=True) and any(texts)
