"""`bench cost` on the CPU compiler at tiny shapes: the layer extrapolation, the compiled cost against the formula,
the opaque-kernel accounting, the projection arithmetic, the CLI with its cache, and a missing compiler.

Stated factor: on a weight-dominated tiny model the compiled FLOPs of a forward of >= 16 tokens lie within 1.5x
of the formula's (the formula leaves out norms, RoPE, softmax and sampling). Bytes are not held to the formula
on a CPU: its cost analysis counts every unfused op's operands (the suite turns most optimisations off), so
they only have to cover the weights, which every forward reads once.
"""

import json
import math
import pathlib

import jax
import pytest

from d2f_jax.bench import cost
from d2f_jax.bench.cost import compiled as cost_compile, model as cm
from d2f_jax.decode.forward_probes import StepShape
from d2f_jax.decode.widths import ms_at_width
from d2f_jax.models import ModelConfig
from d2f_jax import sharding

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "main_job_results.json"
# Small but weight-dominated: 2 layers' 1.05 M matmul weights + a 0.5 M head against a 16-token window.
SMALL = ModelConfig(vocab_size=2048, embed_dim=256, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=64,
                    mlp_dim=1024, dtype="bfloat16", param_dtype="bfloat16", attention_impl="xla",
                    mask_token_id=2000, eos_token_id=2001, pad_token_id=2001)


def _mesh():
  return sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])


def test_extrapolated_layers_match_the_full_depth_and_flops_match_the_formula():
  deep = SMALL.replace(num_layers=4)  # one layer past the fitted depths (2, 3): the line is checked, not met
  shape = StepShape("d2f_step", batch=1, prompt=32, new_tokens=32, block_size=8, width=2)
  got = cost_compile.compiled_forward(deep, shape, _mesh(), log=lambda _: None)
  direct = cost_compile.program_cost(deep, shape, _mesh(), deep.num_layers)  # 4 layers, unrolled
  assert got["flops"] == pytest.approx(direct["flops"], rel=0.03), (got, direct)
  # Bytes within 8%: the CPU compile (most optimisations off in the suite) counted 5.5% more at 4 layers than
  # the line through 2 and 3 (the H100 compile is linear from 2 layers on, see cost_compile).
  assert got["bytes"] == pytest.approx(direct["bytes"], rel=0.08), (got, direct)
  assert got["opaque"] == [] and got["kernel"]["flops"] == 0  # XLA attention: nothing hidden from the compiler
  formula = cm.formula_cost(deep, shape, {"data": 1, "tensor": 1})
  assert 1.0 <= got["flops"] / formula["flops"] <= 1.5, (got, formula)
  weights = 2 * (4 * (256 * 256 * 2 + 256 * 128 * 2 + 3 * 256 * 1024) + 256 * 2048)
  assert got["bytes"] >= weights
  # The in-place cache write is counted as the whole cache read and written (k and v, 4 layers, 64 slots) ...
  cache_bytes = 2 * 4 * 1 * 64 * 2 * 64 * 2
  assert got["write"]["bytes"] >= 2 * cache_bytes, got["write"]
  # ... and replaced by the formula's rows: 16 window tokens' k and v, read and written.
  write = cm.cache_write_formula(deep, shape, {"data": 1, "tensor": 1})
  assert write == {"flops": 0.0, "bytes": 2 * 2 * 2 * 4 * 1 * 16 * 2 * 64}
  # The embedding gather is counted with the whole table (2048 x 256 bf16) as its operand ...
  assert got["gather"]["bytes"] >= 2048 * 256 * 2, got["gather"]
  # ... and replaced by the formula's rows: 16 tokens' 256-wide rows read and written, and their ids.
  gather = cm.gather_cost(deep, shape, {"data": 1, "tensor": 1})
  assert gather == {"flops": 0.0, "bytes": 16 * (2 * 2 * 256 + 4)}
  accounted = cm.accounted_cost(got, deep, shape, {"data": 1, "tensor": 1})
  assert accounted["source"] == "compiled + cache-write formula + embedding-gather formula"
  assert accounted["bytes"] == pytest.approx(got["bytes"] - got["write"]["bytes"] + write["bytes"]
                                             - got["gather"]["bytes"] + gather["bytes"])
  assert accounted["flops"] == pytest.approx(got["flops"] - got["write"]["flops"] - got["gather"]["flops"])


def test_an_opaque_kernel_is_replaced_by_the_attention_formula():
  shape = StepShape("d2f_step", batch=4, prompt=96, new_tokens=32, block_size=8, width=3)
  compiled = {"flops": 1e9, "bytes": 5e8, "opaque": ["tpu_custom_call"], "kernel": {"flops": 2.0, "bytes": 1e6}}
  attn = cm.attention_cost(SMALL, shape, {"data": 1, "tensor": 1})
  # 4 rows x 24 queries x (96 + 16 cached + 24 window keys) x 4 heads x 64 x 3 layers, QK^T and PV
  assert attn["flops"] == 4 * 4 * 24 * (112 + 24) * 4 * 64 * 3
  got = cm.accounted_cost(compiled, SMALL, shape, {"data": 1, "tensor": 1})
  assert got["flops"] == pytest.approx(1e9 - 3 * 2.0 + attn["flops"])
  assert got["bytes"] == pytest.approx(5e8 - 3 * 1e6 + attn["bytes"])
  assert got["source"] == "compiled + attention formula"


def test_byte_counts_that_cannot_be_traffic_are_replaced_by_the_formula_for_the_whole_table():
  """libtpu's 'bytes accessed' came out negative or under the weights (v5e-8); such a count is refused."""
  import argparse
  from d2f_jax.aot import topology as topo
  from d2f_jax.models import preset
  tiny = preset("tiny-llada", dtype="bfloat16", param_dtype="bfloat16")
  mesh = {"data": 1, "fsdp": 1, "tensor": 1}
  floor = cm.weights_per_device(tiny, mesh)
  shapes = [dict(kind="ar_step", batch=b, prompt=32, new_tokens=32, block_size=8, width=1) for b in (1, 4)]
  entry = lambda shape, nbytes: {"model": "tiny-llada", "cache_len": 64, "shape": shape, "mesh": mesh,
                                 "compiled": {"flops": 1e6 * shape["batch"], "bytes": nbytes, "opaque": []}}
  assert cm.implausible_bytes({"bytes": -1e6}, {"bytes": 2 * floor}, tiny, mesh) == "the compiler counts -0.001 GB"
  assert "under the" in cm.implausible_bytes({"bytes": floor}, {"bytes": floor / 2}, tiny, mesh)
  assert cm.implausible_bytes({"bytes": floor}, {"bytes": floor}, tiny, mesh) is None
  args = argparse.Namespace(datasheet="H100 SXM", project="1,8", frontier=False)
  results = json.loads(FIXTURE.read_text())
  for low, refused in ((2 * floor, False), (floor / 3, True)):
    entries = {"a": entry(shapes[0], low), "b": entry(shapes[1], 3 * floor)}
    (table,) = cost.tables(topo.parse_target("cpu"), entries, results, args, log=lambda *_: None)
    got = [e["accounted"] for e in table["entries"]]
    assert ("not HBM traffic" in table["title"]) == refused
    if refused:  # both programs, the plausible one too: one compiler's byte model is trusted whole or not at all
      assert [a["bytes"] for a in got] == [e["formula"]["bytes"] for e in table["entries"]]
      assert all(a["source"].endswith("; bytes: formula") for a in got)
      assert "ar_step width 1 batch 1" in table["title"]
    else:
      assert [a["bytes"] for a in got] == [2 * floor, 3 * floor]
  # each count above the weights, but fewer bytes at batch 4 than at batch 1: not traffic either
  falling = {"a": entry(shapes[0], 3 * floor), "b": entry(shapes[1], 2 * floor)}
  assert "fewer" in cost.implausible_group(list(falling.values()))
  (table,) = cost.tables(topo.parse_target("cpu"), falling, results, args, log=lambda *_: None)
  assert "ar_step width 1: " in table["title"] and "at batch 4" in table["title"]
  assert [e["accounted"]["bytes"] for e in table["entries"]] == [e["formula"]["bytes"] for e in table["entries"]]


def test_projection_arithmetic():
  assert cm.affine({1: 2.0, 33: 6.0}, 17) == pytest.approx(4.0)
  with pytest.raises(ValueError, match="two batches"):
    cm.affine({1: 2.0}, 8)
  assert ms_at_width({1: 1.0, 2: 2.0, 3: 4.0}, 2.5) == pytest.approx(3.0)
  assert ms_at_width({1: 1.0, 2: 2.0}, 7.0) == 2.0  # clamped to the widest compiled
  ms = {"d2f_step": {2: 10.0, 3: 12.0}, "ar_step": 5.0, "d2f_prefill": 20.0, "ar_prefill": 20.0}
  d2f = {"method": "d2f", "tokens_per_forward": 4.0, "mean_window_blocks": 2.5}
  assert cm.decode_ms(d2f, ms, 256) == pytest.approx(20 + 63 * 11.0)
  # A throughput mode's window in positions (not whole blocks of the compiled size): 80 positions = 2.5 blocks
  # of 32; the blocks of the row's own decode (here 16) no longer matter.
  mode = {"method": "d2f", "tokens_per_forward": 4.0, "mean_window_blocks": 5.0, "mean_window_positions": 80.0}
  assert cm.decode_ms(mode, ms, 256, block_size=32) == pytest.approx(20 + 63 * 11.0)
  # At a batch the window is the one measured there (a forward as wide as its widest row): 2.5 blocks alone,
  # 3 at batch 32, log2-linear between (2.75 at batch 5.66 ~ 2^2.5), the largest's beyond it.
  batched = {**mode, "window_at_batch": {"32": {"mean_window_blocks": 6.0, "mean_window_positions": 96.0}}}
  assert cm.decode_ms(batched, ms, 256, block_size=32, batch=1) == pytest.approx(20 + 63 * 11.0)
  assert cm.decode_ms(batched, ms, 256, block_size=32, batch=32) == pytest.approx(20 + 63 * 12.0)
  assert cm.decode_ms(batched, ms, 256, block_size=32, batch=2 ** 2.5) == pytest.approx(20 + 63 * 11.5)
  assert cm.decode_ms(batched, ms, 256, block_size=32, batch=128) == pytest.approx(20 + 63 * 12.0)
  assert cm.decode_ms({**batched, "window_at_batch": {"32": {}}}, ms, 256, block_size=32, batch=32) == (
      pytest.approx(20 + 63 * 11.0))  # a method without windows at batch (older results) keeps its own
  assert cm.decode_ms({"method": "ar", "tokens_per_forward": 1.0}, ms, 256) == pytest.approx(20 + 255 * 5.0)
  assert cm.decode_ms({"method": "vanilla", "tokens_per_forward": 0.5}, ms, 256) is None  # not compiled
  assert cm.crossover(lambda b: 3.0 / b) == "4"  # equal at 3, AR faster from 4
  assert cm.crossover(lambda b: 0.5) == "-"
  assert cm.crossover(lambda b: 2.0, limit=8) == "> 8"


def test_cli_on_the_cpu_compiler_prints_projections_and_reuses_its_cache(tmp_path, capsys):
  argv = ["--target", "cpu", "--tiny", "--model", "tiny-llada", "--programs", "d2f_step,ar_step", "--widths", "1,2",
          "--batch", "1,4", "--datasheet", "H100 SXM", "--results", str(FIXTURE), "--cache", str(tmp_path / "c"),
          "--json", str(tmp_path / "out.json")]
  assert cost.main(argv) == 0
  first = capsys.readouterr().out
  assert "compiled in" in first and "PROJECTION (not a measurement)" in first
  assert "not HBM traffic" not in first  # the CPU compiler's bytes cover the weights: its own count is used
  report = json.loads((tmp_path / "out.json").read_text())
  (table,) = report["tables"]
  assert [(p["program"], p["width"], p["batch"]) for p in table["programs"]] == [
      ("d2f_step", 1, 1), ("d2f_step", 2, 1), ("ar_step", "", 1), ("d2f_step", 1, 4), ("d2f_step", 2, 4),
      ("ar_step", "", 4)]
  methods = {(m["method"], m["settings"]): m for m in table["methods"]}
  d2f = methods[("d2f", "add=0.1 act=0.95 conf=0.9")]
  for b in (1, 8, 32, 128):
    compiled, formula = d2f[f"tok/s b{b}"].split(" / ")
    assert float(compiled) > 0 and float(formula) > 0
    assert d2f[f"vs AR b{b}"].count("x") == 2
  assert " / " in d2f["AR faster from batch"]
  assert methods[("vanilla", "LLaDA semi-AR, 40 steps")]["tok/s b1"] == " / "  # full_step not compiled
  assert report["frontier"] == []  # the fixture's rows carry no DecodeConfig: no exact D2F row to hold modes to

  # --frontier with rows that record their DecodeConfig (as the miniature writes them): one row a batch.
  results = json.loads(FIXTURE.read_text())
  paper = {"tau_add": 0.1, "tau_act": 0.95, "tau_conf": 0.9, "query_limit": None, "position_budget": None,
           "max_blocks_in_flight": None}
  for r in results["rows"]:
    if r["method"] == "d2f":
      r["decode"] = paper if r["settings"] == "add=0.1 act=0.95 conf=0.9" else {**paper, "tau_add": 0.5}
  (tmp_path / "modes.json").write_text(json.dumps(results))
  argv[argv.index(str(FIXTURE))] = str(tmp_path / "modes.json")
  assert cost.main(argv + ["--frontier"]) == 0
  assert "frontier (the fastest mode within one standard error" in capsys.readouterr().out
  frontier = json.loads((tmp_path / "out.json").read_text())["frontier"]
  assert [(r["target"], r["batch"]) for r in frontier] == [("cpu", b) for b in (1, 8, 32, 128)]
  assert all(r["tok_s_compiled"] > 0 and r["ar_tok_s_compiled"] > 0 for r in frontier)
  # Every row has every column (a table printed from rows takes them all; vanilla rows first lack the crossover).
  assert len({tuple(m) for m in table["methods"]}) == 1 and "AR faster from batch" in first
  assert cost.main(argv) == 0  # everything from the cache now
  assert "compiled in" not in capsys.readouterr().out


def test_a_target_without_its_compiler_exits_2_naming_the_venv(tmp_path, capsys):
  argv = ["--target", "h100", "--results", str(FIXTURE), "--accel_venvs", str(tmp_path), "--cache", ""]
  assert cost.main(argv) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: h100 needs its compiler") and str(tmp_path) in err[0]


def test_bad_arguments_name_the_value(tmp_path):
  with pytest.raises(SystemExit) as exit_info:
    cost.main(["--target", "cpu", "--batch", "1", "--results", str(FIXTURE)])
  assert exit_info.value.code == 2
  with pytest.raises(ValueError, match="--cache_len 256 must exceed --new_tokens 256"):
    cost.plan(cost.build_parser().parse_args(["--target", "cpu", "--cache_len", "256"]))


def test_the_uncorrected_logits_row_gathers_move_no_packaged_projection():
  """The D2F step's row gathers from the logits (decode/pipeline.py) are counted by the compilers as the whole
  [b, n, V] array each and not corrected (cost_model.accounted_cost). That must stay harmless: at the largest
  packaged batch every D2F step is bound by its FLOPs (so fewer bytes cannot move its ms), and at batch 1 two
  float32 logits arrays (a device's vocab share) are under 2% of the step's accounted bytes."""
  import json
  import pathlib
  from d2f_jax import datasheets
  from d2f_jax.aot import topology as topo
  from d2f_jax.bench import cost as bench
  from d2f_jax.models import preset
  folder = pathlib.Path(bench.__file__).parent.parent / "compiled_costs"  # d2f_jax/bench/compiled_costs
  checked = 0
  for path in sorted(folder.glob("*.json")):
    sheet = datasheets.by_name(bench.SHEETS[topo.parse_target(path.stem).kind])
    groups = {}
    for e in json.loads(path.read_text()).values():
      groups.setdefault((e["model"], e["cache_len"]), []).append(e)
    for group in groups.values():
      if bench.implausible_group(group):
        continue  # the table reads the formula's bytes: no compiled byte for the gathers to move
      steps = [e for e in group if e["shape"]["kind"] == "d2f_step"]
      largest = max(e["shape"]["batch"] for e in steps)
      for e in steps:
        config = preset(e["model"], dtype="bfloat16", param_dtype="bfloat16")
        shape = StepShape(**e["shape"])
        accounted = cm.accounted_cost(e["compiled"], config, shape, e["mesh"])
        flops_s = accounted["flops"] / (sheet.bf16_tflops * 1e12)
        bytes_s = accounted["bytes"] / (sheet.hbm_gbps * 1e9)
        where = (path.name, e["model"], e["cache_len"], e["shape"])
        if shape.batch == largest:
          assert flops_s > bytes_s, where
        else:
          rows = cm.rows_per_device(shape.batch, e["mesh"].get("data", 1))
          vocab = config.vocab_size / e["mesh"].get("tensor", 1)  # the logits are split over vocab
          assert 2 * rows * shape.tokens * vocab * 4 < 0.02 * accounted["bytes"], where
        checked += 1
  assert checked >= 2 * 2 * 2 * 2, checked  # GPU targets x models x cache lengths x batches, at least


def test_the_frontier_takes_the_fastest_mode_within_one_standard_error_of_exact_d2f():
  from d2f_jax.bench.cost import report as cost_report
  step = {"d2f_step": {1: 4.0, 2: 6.0, 3: 8.0}, "ar_step": 3.0, "d2f_prefill": 10.0, "ar_prefill": 10.0}
  tables = {s: {1: step, 32: {k: ({w: 8 * ms for w, ms in v.items()} if isinstance(v, dict) else 8 * v)
                                  for k, v in step.items()}} for s in cost_report.SOURCES}
  paper = {"tau_add": 0.1, "tau_act": 0.95, "tau_conf": 0.9, "max_blocks_in_flight": None, "position_budget": None}

  def row(settings, accuracy, tokens_per_forward, positions, query_limit=None, method="d2f"):
    return {"method": method, "settings": settings, "accuracy": accuracy, "stderr": 5.0,
            "tokens_per_forward": tokens_per_forward, "mean_window_blocks": positions / 32,
            "mean_window_positions": positions, "decode": {**paper, "query_limit": query_limit}}

  exact = row("add=0.1 act=0.95 conf=0.9", 60.0, 3.0, 96)
  close = row("add=0.1 act=0.95 conf=0.9 q=8", 56.0, 2.5, 40, query_limit=8)  # within 5 points, narrower
  wrong = row("add=0.5 act=0.9 conf=0.7", 40.0, 5.0, 64)  # faster still, but 20 points worse
  ar = {"method": "ar", "settings": "KV cache", "accuracy": 70.0, "stderr": 5.0, "tokens_per_forward": 1.0}
  got = cost_report.frontier_rows([exact, close, wrong, ar], tables, [1, 32], 256, 32, target="h100")
  assert [(r["batch"], r["mode"]) for r in got] == [(1, "add=0.1 act=0.95 conf=0.9 q=8"),
                                                    (32, "add=0.1 act=0.95 conf=0.9 q=8")]
  first = got[0]
  assert (first["target"], first["exact_accuracy"], first["accuracy"], first["stderr"]) == ("h100", 60.0, 56.0, 5.0)
  want = cost_report.tokens_per_s(close, tables["compiled"], 1, 256, 32)
  assert first["tok_s_compiled"] == pytest.approx(want)
  assert first["ar_tok_s_compiled"] == pytest.approx(cost_report.tokens_per_s(ar, tables["compiled"], 1, 256))
  # A mode narrow alone but as wide as exact D2F at batch 32 (its widest row) loses batch 32 to the exact row.
  widening = {**close, "window_at_batch": {"32": {"mean_window_positions": 96.0, "mean_window_blocks": 3.0}}}
  got = cost_report.frontier_rows([exact, widening, ar], tables, [1, 32], 256, 32)
  assert [r["mode"] for r in got] == ["add=0.1 act=0.95 conf=0.9 q=8", "exact"]
  assert [r["window_measured_at_batch"] for r in got] == [1, 1]  # exact has no batch-32 window: its own
  got = cost_report.frontier_rows([exact, widening, ar], tables, [8, 32], 256, 32)
  assert [(r["mode"], r["window_measured_at_batch"]) for r in got] == [("add=0.1 act=0.95 conf=0.9 q=8", 1),
                                                                       ("exact", 1)]
  narrower = {**close, "window_at_batch": {"32": {"mean_window_positions": 64.0, "mean_window_blocks": 2.0}}}
  got = cost_report.frontier_rows([exact, narrower, ar], tables, [32, 128], 256, 32)
  assert [(r["mode"], r["window_measured_at_batch"]) for r in got] == [("add=0.1 act=0.95 conf=0.9 q=8", 32)] * 2
  # Without the narrower mode the exact row is its own frontier; without an AR row there is none.
  assert {r["mode"] for r in cost_report.frontier_rows([exact, wrong, ar], tables, [1], 256, 32)} == {"exact"}
  assert cost_report.frontier_rows([exact, close], tables, [1], 256, 32) == []


@pytest.mark.parametrize("name, active", [("llada2-mini", 1.4e9), ("llada2-flash", 6.1e9)])
def test_the_formula_reads_the_chosen_experts_at_one_token_and_all_as_the_batch_grows(name, active):
  """A mixture of experts: FLOPs follow the active parameters (the published ~1.4B / 6.1B with embedding and
  head), a one-token forward reads only them, and the experts read grow with the tokens to every stored one
  (the checkpoint's own tensor count); a dense model reads all its weights at any size."""
  from d2f_jax.convert.mapping import param_shapes
  from d2f_jax.e2e import projection
  from d2f_jax.models import preset
  config = preset(name)
  head_and_embed = 2 * config.embed_dim * config.vocab_size
  assert abs(projection.layer_params(config) + head_and_embed - active) / active < 0.05
  stored = sum(math.prod(s) for s in param_shapes(config).values()) - head_and_embed
  reads = [projection.layer_params_read(config, t) for t in (1, 8, 88, 704, 11264, 1e6)]
  assert reads[0] == projection.layer_params(config) and reads == sorted(reads)
  assert reads[2] > 10 * reads[0]  # one D2F window of 88 tokens already touches most experts
  assert abs(reads[-1] - stored) / stored < 1e-3, (reads[-1], stored)  # norms and router bias aside
  llada = preset("llada-8b")
  assert projection.layer_params_read(llada, 1) == projection.layer_params_read(llada, 4096)
  one, many = projection.roofline_forward(config, 1.0, 0.0), projection.roofline_forward(config, 1.0, 0.0, rows=64)
  assert many[0] == pytest.approx(64 * one[0]) and one[1] < many[1] < 64 * one[1]  # weights shared by the rows
