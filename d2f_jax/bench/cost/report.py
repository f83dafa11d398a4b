"""The cost bench's tables: per program (compiled vs formula ms per forward) and per method (projected tokens/s
at each batch, D2F / AR, the crossover batch), every number from one target's costs. All are projections."""

from __future__ import annotations

from d2f_jax.bench.cost import model as cm
from d2f_jax.decode.forward_probes import StepShape
from d2f_jax.e2e import projection

SOURCES = ("compiled", "formula")


def program_rows(entries: list[dict], sheet) -> list[dict]:
  """One row per compiled program: the compiler's count, what attention was accounted as, and ms per
  forward from the accounted cost beside the formula's."""
  rows = []
  for e in entries:
    acc, form = e["accounted"], e["formula"]
    ms, fms = cm.milliseconds(acc, sheet), cm.milliseconds(form, sheet)
    rows.append({"program": e["shape"]["kind"], "width": e["shape"]["width"] if e["shape"]["kind"] == "d2f_step" else "",
                 "batch": e["shape"]["batch"], "tokens": StepShape(**e["shape"]).tokens,
                 "compiler GFLOP": cm.fmt(e["compiled"]["flops"] / 1e9), "compiler GB": cm.fmt(e["compiled"]["bytes"] / 1e9),
                 "attention": "formula (kernel opaque)" if e["compiled"]["opaque"] else "compiled",
                 "GFLOP": cm.fmt(acc["flops"] / 1e9), "GB": cm.fmt(acc["bytes"] / 1e9),
                 "ms/fwd compiled": cm.fmt(ms), "ms/fwd formula": cm.fmt(fms), "compiled / formula": f"{ms / fms:.2f}"})
  return rows


def ms_tables(entries: list[dict], sheet) -> dict[str, dict[int, dict]]:
  """{source: {compiled batch: {'d2f_step': {width: ms}, 'ar_step': ms, ...}}} from the program entries."""
  out = {s: {} for s in SOURCES}
  for e in entries:
    kind, batch = e["shape"]["kind"], e["shape"]["batch"]
    for source, cost in (("compiled", e["accounted"]), ("formula", e["formula"])):
      table = out[source].setdefault(batch, {"d2f_step": {}})
      ms = cm.milliseconds(cost, sheet)
      if kind == "d2f_step":
        table["d2f_step"][e["shape"]["width"]] = ms
      else:
        table[kind] = ms
  return out


def tokens_per_s(row: dict, by_batch: dict[int, dict], batch: int, new_tokens: int,
                 block_size: int | None = None) -> float | None:
  """Projected tokens/s of a results row at `batch`: batch x new_tokens / the decode's ms, each program's
  ms affine in the rows between the compiled batches (block_size: the compiled steps', cm.decode_ms)."""
  first = next(iter(by_batch.values()))
  at = {"d2f_step": {w: cm.affine({b: t["d2f_step"][w] for b, t in by_batch.items()}, batch)
                     for w in first["d2f_step"]}}  # {} when no D2F step was compiled
  for kind in first:
    if kind != "d2f_step":
      at[kind] = cm.affine({b: t[kind] for b, t in by_batch.items()}, batch)
  ms = cm.decode_ms(row, at, new_tokens, block_size, batch)
  return None if not ms else 1000 * batch * new_tokens / ms


def method_rows(results: list[dict], tables: dict, batches: list[int], new_tokens: int,
                block_size: int | None = None) -> list[dict]:
  """One row per results row: tokens/s at each batch and D2F / AR ('compiled / formula' per cell), and the
  crossover batch above which AR is faster (block_size: the compiled steps', cm.decode_ms)."""
  ar = next((r for r in results if r["method"] == "ar"), None)
  rows = []
  for r in results:
    if not r.get("tokens_per_forward"):
      continue
    row = {"method": r["method"], "settings": r.get("settings", ""), "tokens/fwd": f"{r['tokens_per_forward']:.2f}",
           "window blocks": f"{r['mean_window_blocks']:.2f}" if r.get("mean_window_blocks") else ""}
    speed = {s: {b: tokens_per_s(r, tables[s], b, new_tokens, block_size) for b in batches} for s in SOURCES}
    for b in batches:
      row[f"tok/s b{b}"] = " / ".join(cm.fmt(speed[s][b], 4) for s in SOURCES)
    base = {s: {b: tokens_per_s(ar, tables[s], b, new_tokens) for b in batches} for s in SOURCES} if ar else None
    if base and r is not ar and speed["compiled"][batches[0]] and base["compiled"][batches[0]]:
      for b in batches:
        row[f"vs AR b{b}"] = " / ".join(f"{speed[s][b] / base[s][b]:.2f}x" if speed[s][b] and base[s][b] else "-"
                                        for s in SOURCES)
      if r["method"] in ("d2f", "threshold"):
        row["AR faster from batch"] = " / ".join(_crossover(r, ar, tables[s], new_tokens, block_size)
                                                 for s in SOURCES)
    rows.append(row)
  columns = list(dict.fromkeys(k for row in rows for k in row))  # tables take their columns from every row
  return [{k: row.get(k, "") for k in columns} for row in rows]


def _crossover(row: dict, ar: dict, table: dict, new_tokens: int, block_size: int | None = None) -> str:
  def ratio(b):
    d2f, base = tokens_per_s(row, table, b, new_tokens, block_size), tokens_per_s(ar, table, b, new_tokens)
    return d2f / base if d2f and base else float("nan")
  return "-" if ratio(1) != ratio(1) else cm.crossover(ratio)


def markdown(rows: list[dict]) -> str:
  """A GitHub table of `rows` (README-ready)."""
  if not rows:
    return "(no rows)"
  cols = list(dict.fromkeys(k for r in rows for k in r))
  lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
  lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
  return "\n".join(lines)


PAPER = (0.1, 0.95, 0.9)  # (tau_add, tau_act, tau_conf): the exact D2F row the modes are held to


def is_exact_d2f(row: dict) -> bool:
  """The authors' loop at the paper's thresholds: no throughput mode (query limit, position budget, cap) and
  the run's own decode block (a results row records its DecodeConfig under 'decode')."""
  d = row.get("decode") or {}
  return (row["method"] == "d2f" and d.get("query_limit") is None and d.get("position_budget") is None
          and d.get("max_blocks_in_flight") is None and not d.get("cache_decided")
          and (d.get("tau_add"), d.get("tau_act"), d.get("tau_conf")) == PAPER)


def frontier_rows(results: list[dict], tables: dict, batches: list[int], new_tokens: int, block_size: int,
                  **where) -> list[dict]:
  """Per batch, the fastest D2F row (compiled tokens/s) whose accuracy is within one standard error of the
  exact D2F row's, with AR's tokens/s beside: the mode a server should run at that load (its block_size,
  query_limit and cache_decided as the serving engine's --frontier reads them). `where` (target, model, cache_len) is copied
  into every row. [] without an exact D2F row or an AR row."""
  exact = next((r for r in results if is_exact_d2f(r) and r.get("tokens_per_forward")), None)
  ar = next((r for r in results if r["method"] == "ar" and r.get("tokens_per_forward")), None)
  if exact is None or ar is None:
    return []
  floor = exact["accuracy"] - exact["stderr"]
  modes = [r for r in results if r["method"] in ("d2f", "threshold") and r.get("tokens_per_forward")
           and r["accuracy"] >= floor]
  out = []
  for b in batches:
    speed = {id(r): {s: tokens_per_s(r, tables[s], b, new_tokens, block_size) for s in SOURCES} for r in modes}
    fastest = max(modes, key=lambda r: speed[id(r)]["compiled"] or 0.0)
    base = {s: tokens_per_s(ar, tables[s], b, new_tokens) for s in SOURCES}
    decode = fastest.get("decode") or {}
    out.append({**where, "batch": b, "mode": "exact" if fastest is exact else fastest["settings"],
                "block_size": decode.get("block_size"), "query_limit": decode.get("query_limit"),
                "cache_decided": bool(decode.get("cache_decided")),
                "window_measured_at_batch": projection.window_batch(fastest, b),
                "accuracy": fastest["accuracy"], "exact_accuracy": exact["accuracy"], "stderr": exact["stderr"],
                "tok_s_compiled": speed[id(fastest)]["compiled"], "tok_s_formula": speed[id(fastest)]["formula"],
                "ar_tok_s_compiled": base["compiled"], "ar_tok_s_formula": base["formula"]})
  return out
