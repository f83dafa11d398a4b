"""Every command line, the way a user meets it: `--help` exits 0 listing each flag with its default (or
"(required)"), and a mistake (a bad path, a misspelled override, an unknown config variant, bad JSON, a bad
flag value) is exactly one `error: ...` line on stderr naming it, exit status 2, no traceback, before any
model loads. The command lines run through tests/cli_cases.py (one subprocess, a fork per command line, as
`python -m` runs them); two run as plain `python -m` subprocesses to show it is the same."""

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from d2f_jax.bench import BENCHMARKS as BENCHES
HELP = [("d2f_jax.main", []), ("d2f_jax.distill", []), ("d2f_jax.generate", []), ("d2f_jax.evaluate", []),
        ("d2f_jax.convert", []), ("d2f_jax.aot", []), ("d2f_jax.serve", []), ("d2f_jax.bench", [])] + [("d2f_jax.bench", [b]) for b in BENCHES]


def bad_cases(tmp):
  """(module, args, what the one error line must contain)."""
  bad_json, model = os.path.join(tmp, "bad_json"), os.path.join(tmp, "model")
  data, frontier = os.path.join(tmp, "bad.jsonl"), os.path.join(tmp, "frontier.json")
  w = ["--workdir", os.path.join(tmp, "w")]
  return [
      ("d2f_jax.main", ["--config", "configs/nope.py"], "config file 'configs/nope.py' does not exist"),
      ("d2f_jax.main", ["--config.seedd=1"], "did you mean --config.seed?"),
      ("d2f_jax.main", ["--config", "configs/tiny_e2e.py:smok"], "'smok' is not a known switch"),
      ("d2f_jax.main", ["--nope"], "Unknown command line flag 'nope'"),
      ("d2f_jax.main", ["--config", "configs/tiny_e2e.py:long", "--config.max_new_tokens=250", *w],
       "config.max_new_tokens (250) must be a multiple of the decode block (32: config.decode_block_size"),
      ("d2f_jax.distill", ["--config", "configs/nope.py", *w], "does not exist"),
      ("d2f_jax.distill", ["--config", "configs/tiny.py", *w, "--config.optim.lrr=1"],
       "did you mean --config.optim.lr?"),
      ("d2f_jax.distill", ["--config", "configs/tiny.py", *w, "--config.optim.lr=abc"], "--config.optim.lr=abc"),
      ("d2f_jax.distill", ["--config", "configs/tiny.py"], "--workdir is required"),
      ("d2f_jax.generate", ["--model", "/nonexistent/m", "--prompt", "hi"], "'/nonexistent/m' does not exist"),
      ("d2f_jax.generate", ["--model", bad_json, "--prompt", "hi"], "config.json: not valid JSON"),
      ("d2f_jax.generate", ["--model", model, "--prompt", "hi", "--block_size", "3"], "multiple of block_size"),
      ("d2f_jax.generate", ["--prompt", "hi"], "required: --model"),
      ("d2f_jax.evaluate", ["--model", "/nonexistent/m", "--task", "gsm8k"], "'/nonexistent/m' does not exist"),
      ("d2f_jax.evaluate", ["--model", model, "--task", "gsm8k", "--data", data], "cannot read the gsm8k data"),
      ("d2f_jax.evaluate", ["--model", model, "--task", "gsm9k"], "invalid choice: 'gsm9k'"),
      ("d2f_jax.evaluate", ["--model", model, "--task", "gsm8k", "--arithmetic_test", "3"],
       "--arithmetic_test only apply to --task arithmetic"),
      ("d2f_jax.convert", ["--hf_dir", "/nonexistent/m", "--out", os.path.join(tmp, "o")], "/nonexistent/m"),
      ("d2f_jax.convert", ["--hf_dir", bad_json, "--out", os.path.join(tmp, "o")], "config.json: not valid JSON"),
      ("d2f_jax.convert", ["--hf_dir", model, "--max_shard_gb", "x"], "--max_shard_gb: invalid float value"),
      ("d2f_jax.aot", ["--target", "cpu-8", "--config", "configs/nope.py"], "does not exist"),
      ("d2f_jax.aot", ["--target", "cpu-8", "--config", "configs/llada_8b.py", "--config.optim.lrr=1"], "did you mean"),
      ("d2f_jax.aot", ["--target", "cpu-8", "--config", "configs/llada_8b.py:nope"], "'nope'"),
      ("d2f_jax.aot", ["--target", "v9-8", "--config", "configs/llada_8b.py"], "unknown target"),
      ("d2f_jax.bench", ["decods"], "unknown benchmark 'decods'"),
      ("d2f_jax.bench", ["decode", "--batch", "x"], "--batch: invalid int value"),
      ("d2f_jax.bench", ["train", "--nope"], "unrecognized arguments: --nope"),
      ("d2f_jax.bench", ["convert", "--shards", "x"], "--shards: invalid int value"),
      ("d2f_jax.bench", ["serve", "--slots", "0"], "expected positive slot counts"),
      ("d2f_jax.serve", ["--model", "/nonexistent/m"], "/nonexistent/m"),
      ("d2f_jax.serve", ["--model", bad_json], "not valid JSON"),
      ("d2f_jax.serve", ["--model", model, "--slots", "0"], "--slots must be a positive int"),
      ("d2f_jax.serve", ["--model", model, "--method", "ar", "--query_limit", "4"],
       "--query_limit must be None or a positive int on a 'd2f' engine"),
      ("d2f_jax.serve", ["--model", model, "--position_budget", "0"], "--position_budget must be None or a positive"),
      ("d2f_jax.serve", ["--model", model, "--policy", "throughput"], "--policy 'throughput' decodes every request "
                                                                      "at query_limit: set query_limit"),
      ("d2f_jax.serve", ["--model", model, "--auto_modes", "8:x"], "--auto_modes must be 'SLOTS:Q,...'"),
      ("d2f_jax.serve", ["--model", model, "--api_key", ""], "--api_key (or $D2F_API_KEY) must not be empty"),
      ("d2f_jax.serve", ["--model", model, "--frontier", "/nonexistent/f.json"],
       "--frontier /nonexistent/f.json: not a `bench cost --frontier --json` report"),
      ("d2f_jax.serve", ["--model", model, "--frontier", frontier], "choose one with --frontier_target"),
      ("d2f_jax.serve", ["--model", model, "--frontier", frontier, "--frontier_target", "h100"],
       "decodes at block size 16, this engine at 32: serve with --block_size 16"),
      ("d2f_jax.generate", ["--model", model, "--prompt_ids", "1", "--query_limit", "0"],
       "query_limit must be a positive int or None"),
      ("d2f_jax.bench", ["serve", "--workdir", "/nonexistent/w"], "no trained D2F student in /nonexistent/w"),
  ]


def _write_inputs(tmp):
  from d2f_jax.convert import hf_config_from_model
  from d2f_jax.models import TINY_DREAM
  os.makedirs(os.path.join(tmp, "bad_json"))
  with open(os.path.join(tmp, "bad_json", "config.json"), "w") as f:
    f.write("{not json")
  os.makedirs(os.path.join(tmp, "model"))  # a readable config.json, no weights: nothing gets that far
  with open(os.path.join(tmp, "model", "config.json"), "w") as f:
    json.dump(hf_config_from_model(TINY_DREAM, dtype="float32"), f)
  frontier = [dict(target=target, model="llada-8b", batch=batch, mode=mode, block_size=block, query_limit=q)
              for target in ("h100", "v5p-8")
              for batch, mode, block, q in ((1, "exact", 32, None), (8, "block=16 q=8", 16, 8))]
  with open(os.path.join(tmp, "frontier.json"), "w") as f:
    json.dump({"frontier": frontier}, f)
  with open(os.path.join(tmp, "bad.jsonl"), "w") as f:
    f.write('{"question": "1 + 1?", "answer": "#### 2"}\n{not json\n')


def _env():
  return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get(
      "PYTHONPATH")])))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  tmp = str(tmp_path_factory.mktemp("cli"))
  _write_inputs(tmp)
  cases = [(m, a + ["--help"]) for m, a in HELP] + [(m, a) for m, a, _ in bad_cases(tmp)]
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "cli_cases.py")], input=json.dumps(cases),
                        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  results = json.loads(proc.stdout)
  return tmp, {(r["module"], tuple(r["args"])): r for r in results}


def _entries(help_text: str) -> list[str]:
  """Each flag's entry of a --help text: argparse's 'options' lines or absl's '--name' blocks."""
  text = help_text.split("\noptions:", 1)[-1] if "\noptions:" in help_text else help_text.split("\nflags:", 1)[1]
  return [e for e in re.split(r"\n(?=  -)", text) if e.strip().startswith("--")]


@pytest.mark.parametrize("module,args", HELP, ids=[" ".join([m] + a) for m, a in HELP])
def test_help_lists_every_flag_with_its_default(runs, module, args):
  r = runs[1][(module, tuple(args + ["--help"]))]
  assert r["code"] == 0 and "Traceback" not in r["err"], r["err"][-2000:]
  if (module, args) == ("d2f_jax.bench", []):  # the dispatcher: every benchmark, each with its summary line
    assert all(f"  {b} " in r["out"] for b in BENCHES) and "NAME --help" in r["out"], r["out"]
    return
  entries = _entries(r["out"])
  assert len(entries) >= 2, r["out"]
  for entry in entries:
    assert "(default" in entry or "(required)" in entry, f"{module} {args}: no default in {entry!r}"


def test_help_texts_name_what_users_need(runs):
  out = {(m, tuple(a)): r["out"] for (m, a), r in runs[1].items()}
  main = out[("d2f_jax.main", ("--help",))]
  assert "--config\n" in main and ":smoke" in main and "--config.FIELD=VALUE" in main
  assert "--config\n" in out[("d2f_jax.distill", ("--help",))]
  for cli in ("d2f_jax.generate", "d2f_jax.evaluate"):
    assert re.search(r"--block_size BLOCK_SIZE\s+tokens per block.*\(default: 32\)", out[(cli, ("--help",))], re.S)
    assert "--lora_dir" in out[(cli, ("--help",))] and "--lora " not in out[(cli, ("--help",))]
  assert "(This module" not in out[("d2f_jax.aot", ("--help",))]
  assert "same run, same tokens." in out[("d2f_jax.bench", ("decode", "--help"))]  # the whole doc, not cut


def _assert_one_error_line(r, expected):
  lines = [line for line in r["err"].splitlines() if line.strip()]
  assert r["code"] == 2 and "Traceback" not in r["err"], (r["code"], r["err"][-3000:])
  assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], r["err"][-3000:]


def test_every_mistake_is_one_error_line_and_exit_2(runs):
  tmp, results = runs
  failures = []
  for module, args, expected in bad_cases(tmp):
    try:
      _assert_one_error_line(results[(module, tuple(args))], expected)
    except AssertionError as e:
      failures.append(f"{module} {' '.join(args)}: {e}")
  assert not failures, "\n".join(failures)


@pytest.mark.parametrize("module,args,expected", [
    ("d2f_jax.main", ["--config.seedd=1"], "did you mean --config.seed?"),
    ("d2f_jax.generate", ["--model", "/nonexistent/m", "--prompt", "hi", "--lora", "/x"], "does not exist"),
])
def test_the_same_as_a_plain_python_m(module, args, expected):
  proc = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=_env(), capture_output=True, text=True,
                        timeout=120)
  _assert_one_error_line({"code": proc.returncode, "err": proc.stderr}, expected)
