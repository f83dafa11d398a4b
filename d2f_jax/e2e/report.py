"""The run's artefacts: results.json, results.md, a throughput-vs-accuracy plot and a decoding-trace picture."""

from __future__ import annotations

import os

import numpy as np

from d2f_jax.reporting import environment, format_table
from d2f_jax.e2e import ceiling, projection
from d2f_jax.e2e.evaluation import decode_block_size
from d2f_jax.reporting import write_json, write_text

# (column title, row key, format)
TABLE = [("method", "method", "{}"), ("model", "model", "{}"), ("settings", "settings", "{}"),
         ("exact match %", None, None), ("tokens/s", "tokens_per_s", "{:.0f}"),
         ("tokens/fwd", "tokens_per_forward", "{:.2f}"), ("blocks in flight", "mean_in_flight", "{:.2f}"),
         ("window blocks", "mean_window_blocks", "{:.2f}"),
         ("positions computed per accepted token", "positions_per_token", "{:.2f}"),
         ("ms/fwd", "ms_per_forward", "{:.3f}"),
         ("vs AR", "speedup_vs_ar", "{:.2f}x"), ("CPU ceiling vs AR", "ceiling_vs_ar", "{:.2f}x"),
         ("vs threshold", "speedup_vs_threshold", "{:.2f}x")]
TABLE_COLUMNS = [title for title, _, _ in TABLE]
STAGE_TEXT = {"ar": "AR pre-training (Dream layout, causal; the AR baseline)",
              "teacher": "MDM adaptation of the AR model, shifted logits (the teacher)",
              "student": "D2F distillation (the student)", "llada_teacher": "LLaDA-layout MDM teacher from scratch"}


def table_rows(rows: list[dict]) -> list[dict]:
  """The results rows as text cells under TABLE_COLUMNS (blank where a column does not apply)."""
  out = []
  for row in rows:
    cells = {}
    for title, key, fmt in TABLE:
      if key is None:
        cells[title] = f"{row['accuracy']:.1f} +- {row['stderr']:.1f}"
      else:
        value = row.get(key)
        cells[title] = "" if value is None else fmt.format(value)
    out.append(cells)
  return out


def add_positions(rows: list[dict], block_size: int, max_new_tokens: int) -> list[dict]:
  """Set each row's `positions_per_token`: positions a forward computes / tokens it accepts, the work D2F
  spends per token (the window for d2f and threshold, the whole sequence for vanilla, 1 for AR)."""
  for row in rows:
    if row["method"] == "ar":
      row["positions_per_token"] = 1.0
    elif row.get("tokens_per_forward") and row.get("mean_window_positions"):  # measured (d2f, threshold)
      row["positions_per_token"] = row["mean_window_positions"] / row["tokens_per_forward"]
    elif row.get("tokens_per_forward") and (row["method"] not in ("d2f", "threshold")
                                            or row.get("mean_window_blocks")):
      n, _ = projection.forward_shape(row, block_size, max_new_tokens)
      row["positions_per_token"] = n / row["tokens_per_forward"]
    else:
      row["positions_per_token"] = None
  return rows


def write_results(out_dir: str, rows: list[dict], stages: dict, config: dict, steps: dict | None = None) -> dict:
  """results.json and results.md; `steps`: the step timings behind the CPU ceiling (e2e/ceiling.py)."""
  block, new = decode_block_size(config), config["max_new_tokens"]
  add_positions(rows, block, new)
  projected = projection.project(rows, block, new)
  payload = {"rows": rows, "projection": projected, "stages": stages, "config": config, "environment": environment(),
             "ceiling": steps or {}}
  write_json(os.path.join(out_dir, "results.json"), payload)
  env = payload["environment"]
  total = rows[0]["total"] if rows else 0
  lines = [
      "# D2F in miniature: results", "",
      f"{total} held-out arithmetic problems, exact match of the final answer (+- one binomial standard error). "
      f"Measured on {env['device']} ({env['cpus']} CPUs), batch 1, greedy, compile time excluded; "
      f"block {block}{_trained_at(config, block)}, at most {new} new tokens.", "",
      "tokens/s = generated tokens (up to the stop token) / wall time of the generate calls, timed in one pass "
      "after the accuracy pass with every prompt decoded by every row in turn, so a busier moment of the machine "
      "slows all rows alike (each row's harness results.json under eval/ has its own, separately timed speed); "
      "tokens/fwd = the same "
      "tokens / model forwards; blocks in flight = blocks still decoding per forward (d2f, threshold); window "
      "blocks = width of the forward's window in blocks (the blocks in flight plus finished ones whose cache it "
      "writes; both at batch 1, in the timing pass); positions computed per accepted token = positions a forward "
      "computes / tokens/fwd (d2f, threshold: the compiled window width at batch 1, measured; results.json's "
      "window_at_batch has them at batch 32, where a forward is as wide as its widest row; vanilla: the whole "
      "sequence, prompt + new tokens; ar: 1); "
      "ms/fwd = wall time / forwards (includes the loop's own work); vs AR / vs threshold = tokens/s "
      "ratios to the AR row and the teacher's threshold row of this run; CPU ceiling vs AR = tokens/fwd x AR step ms "
      "/ D2F step ms at the row's window, both steps timed in this run (below).", "",
      "```", format_table(table_rows(rows), TABLE_COLUMNS), "```", "", *ceiling.ceiling_text(rows, steps or {}),
      "## Projection (not a measurement): LLaDA-8B tokens/s on H100 and TPU v5p", "",
      "From the measured tokens per forward and window widths above, with a roofline per-forward cost of the 8B "
      "model (bf16 weights and KV cache, batch 1): time = max(FLOPs / peak, bytes / HBM bandwidth); FLOPs = "
      "2 n (layer params + head) + 4 n (c + n) H D L, bytes = all weights once + K/V of c cached tokens; "
      "n = the window's tokens (vanilla: the whole sequence, no cache; ar: 1), c = prompt + half the response. "
      "Peaks: H100 SXM 989 TFLOP/s, 3.35 TB/s; TPU v5p 459 TFLOP/s, 2.765 TB/s. Host and kernel overheads "
      "are left out, so these are upper bounds; the ratios between methods are what carries over.", "",
      "```", format_table([{k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in p.items()}
                           for p in projected]) if projected else "(no rows)", "```", "",
      "## Training stages", "",
      "Wall time on the shared CPU; eval_loss / eval_accuracy are the stage's own objective on held-out training "
      "rows: eval_accuracy (ar, mdm) is a token-level top-1 accuracy (of the next token for ar, of masked tokens "
      "for mdm), not the exact match of whole answers in the table above; distill reports eval_kl, the KL "
      "divergence from the teacher on masked tokens.", ""]
  for name, stage in stages.items():
    lines.append(f"- {name} ({STAGE_TEXT.get(name, name)}): " + ", ".join(
        f"{k}={_fmt(v)}" for k, v in stage.items()))
  lines += ["", "Models: workdir/<stage>/hf (Hugging Face format, load with `d2f_jax.load_model`). Prompt format: "
            "`Question <question> Answer`; the model writes the worked solution ending in `So the answer is N.` "
            "and its EOS."]
  _atomic_write(os.path.join(out_dir, "results.md"), "\n".join(lines) + "\n")
  return payload


def _trained_at(config: dict, block: int) -> str:
  """' (distilled at block 16)' where the decode block differs from the training one, else nothing."""
  trained = config.get("block_size")
  return f" (distilled at block {trained})" if trained and trained != block else ""


def _label(row: dict) -> str:
  return f"{row['method']} ({row['settings']}) — {row['model']}"


def plot_throughput(out_dir: str, rows: list[dict]) -> str:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.ticker import LogLocator, ScalarFormatter

  fig, ax = plt.subplots(figsize=(9, 5))
  markers = {"vanilla": "s", "dream_vanilla": "D", "threshold": "^", "d2f": "o", "ar": "P"}
  for row in rows:
    if not row["tokens_per_s"]:
      continue
    ax.errorbar(row["tokens_per_s"], row["accuracy"], yerr=row["stderr"], fmt=markers.get(row["method"], "o"),
                ms=7, capsize=3, label=_label(row))
  ax.set_xscale("log")
  ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
  formatter = ScalarFormatter()
  formatter.set_scientific(False)
  ax.xaxis.set_major_formatter(formatter)
  ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
  ax.set_xlabel("tokens / s on this CPU (log scale)")
  ax.set_ylabel("exact match (%), +- 1 s.e.")
  ax.set_title("throughput vs accuracy, held-out problems, batch 1")
  ax.grid(alpha=0.3, which="both")
  ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
  path = os.path.join(out_dir, "throughput_vs_accuracy.png")
  fig.tight_layout()
  fig.savefig(path, dpi=120, bbox_inches="tight")
  plt.close(fig)
  return path


def plot_trace(out_dir: str, trace: np.ndarray, block_size: int, title: str) -> str:
  """Position x step picture of one D2F decode: a cell is lit at the step its token was accepted, coloured
  by its block, so the overlap of blocks in flight (pipelining) is visible."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.patches import Patch

  trace = np.asarray(trace)
  accepted = trace >= 0
  length = int(np.nonzero(accepted)[0].max()) + 1 if accepted.any() else 1
  steps = int(trace.max()) + 1 if accepted.any() else 1
  blocks = -(-length // block_size)
  colors = plt.get_cmap("tab10")
  grid = np.ones((steps, length, 3))
  for pos in range(length):
    if trace[pos] >= 0:
      grid[trace[pos], pos] = colors(pos // block_size % 10)[:3]
  fig, ax = plt.subplots(figsize=(max(7, length / 6), max(3.5, steps / 5)))
  ax.imshow(grid, aspect="auto", interpolation="nearest", origin="lower",
            extent=(-0.5, length - 0.5, -0.5, steps - 0.5))
  for edge in range(block_size, length, block_size):
    ax.axvline(edge - 0.5, color="gray", lw=0.5)
  ax.set_xlabel(f"generated position (blocks of {block_size})")
  ax.set_ylabel("decoding step (forward)")
  ax.set_title(title, fontsize=9)
  handles = [Patch(color=colors(b % 10), label=f"block {b}: token accepted at this step") for b in range(blocks)]
  ax.legend(handles=handles, fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
  path = os.path.join(out_dir, "decode_trace.png")
  fig.tight_layout()
  fig.savefig(path, dpi=120, bbox_inches="tight")
  plt.close(fig)
  return path


def _fmt(value) -> str:
  return f"{value:.4g}" if isinstance(value, float) else str(value)


def _atomic_write(path: str, text: str) -> None:
  write_text(path, text)
