"""Writes the tutorial notebooks (outputs cleared): `python notebooks/build.py` from the repository root.

Edit the cells here, not in the .ipynb files; tests/test_notebooks.py checks the two agree and runs every
notebook top to bottom on the tiny models.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = os.path.dirname(os.path.abspath(__file__))
ORG = "d2f-jax"
REPO = f"https://github.com/{ORG}/d2f_jax"


def badge(name: str) -> str:
  url = f"https://colab.research.google.com/github/{ORG}/d2f_jax/blob/main/notebooks/{name}.ipynb"
  return f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]({url})"


INSTALL = f'''\
# Install d2f_jax when it is not importable (Colab); inside a checkout, use the checkout.
import os, sys
try:
    import d2f_jax
except ImportError:
    _root = os.path.abspath("..")
    if os.path.isfile(os.path.join(_root, "d2f_jax", "__init__.py")):  # notebooks/ of a checkout
        sys.path.insert(0, _root)
    else:  # the runtime's own accelerator picks the extra, so pip keeps (or fetches) the matching jax
        import jax
        _extra = {{"tpu": "tpu,eval", "gpu": "cuda12,eval"}}.get(jax.default_backend(), "eval")
        get_ipython().run_line_magic("pip", f'install -q "d2f_jax[{{_extra}}] @ git+{REPO}"')
    import d2f_jax
print("d2f_jax", d2f_jax.__version__, "from", os.path.dirname(d2f_jax.__file__))'''


def md(text: str):
  return new_markdown_cell(textwrap.dedent(text).strip())


def code(text: str):
  return new_code_cell(textwrap.dedent(text).strip())


def notebook(name: str, cells: list) -> nbformat.NotebookNode:
  nb = new_notebook(cells=cells)
  for i, cell in enumerate(nb.cells):  # stable ids: rebuilding an unchanged notebook changes nothing
    cell.id = f"{name}-{i:02d}"
  nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
  nb.metadata["language_info"] = {"name": "python"}
  nb.metadata["colab"] = {"name": f"{name}.ipynb", "provenance": []}
  return nb


# --- quickstart --------------------------------------------------------------------------------------

def quickstart() -> nbformat.NotebookNode:
  return notebook("quickstart", [
      md(f"""
      {badge("quickstart")}

      # d2f_jax quickstart: checkpoint → convert → load → D2F decoding

      Discrete diffusion forcing (D2F) decodes a diffusion LLM block by block with a KV cache, many tokens
      per step, and starts a block before its predecessor is finished. This notebook goes through the
      whole user path on a **tiny random LLaDA-format checkpoint** so that it runs on a CPU in seconds;
      every step is the same call for LLaDA-8B / Dream-7B.
      """),
      code(INSTALL),
      code("""
      import json, tempfile
      import jax
      import matplotlib.pyplot as plt
      import numpy as np
      from d2f_jax import convert
      from d2f_jax.convert.synthetic import write_hf_checkpoint, write_peft_adapter
      from d2f_jax.decode import DecodeConfig, generate
      from d2f_jax.models import TINY_LLADA, LoraConfig

      WORK = tempfile.mkdtemp(prefix="d2f_quickstart_")
      print("jax", jax.__version__, jax.devices())
      """),
      md("""
      ## 1. A checkpoint

      With the real models you would download the base model and the released D2F LoRA student:

      ```bash
      huggingface-cli download GSAI-ML/LLaDA-8B-Instruct --local-dir ckpt/LLaDA-8B-Instruct
      huggingface-cli download SJTU-Deng-Lab/D2F_LLaDA_Instruct_8B_Lora --local-dir ckpt/D2F_LLaDA_Lora
      ```

      Here we write a checkpoint in exactly that format instead: `config.json` with LLaDA's field names,
      safetensors with LLaDA's tensor names, a tokenizer, and a PEFT adapter (`adapter_config.json` +
      `adapter_model.safetensors`). Only the sizes are tiny (2 layers, width 64, vocabulary 512) and the
      weights random.
      """),
      code("""
      hf_dir = write_hf_checkpoint(os.path.join(WORK, "hf"), TINY_LLADA, seed=0)
      lora_dir = write_peft_adapter(os.path.join(WORK, "lora"), TINY_LLADA,
                                    LoraConfig(rank=8, alpha=16.0, targets=("q", "k", "v", "o")), seed=1)
      print(sorted(os.listdir(hf_dir)))
      print(sorted(os.listdir(lora_dir)))
      hf_config = json.load(open(os.path.join(hf_dir, "config.json")))
      print({k: hf_config[k] for k in ("model_type", "d_model", "n_layers", "n_heads", "vocab_size", "mask_token_id")})
      """),
      md("""
      ## 2. Convert

      Conversion streams the safetensors into d2f_jax's layout (stacked layers, `[in, out]` matrices) and
      saves an orbax directory that later loads fast, shard by shard, straight onto a device mesh. The LoRA
      adapter is merged into the weights here (`--merge_lora`); without it, it stays a separate tree the
      trainer can continue from. The command line equivalent of the cell below, for the real model:

      ```bash
      python -m d2f_jax.convert --hf_dir ckpt/LLaDA-8B-Instruct --lora_dir ckpt/D2F_LLaDA_Lora --merge_lora \\
          --out ckpt/d2f_llada --dtype bfloat16
      ```
      """),
      code("""
      converted = convert.convert_hf_dir(hf_dir, os.path.join(WORK, "converted"), lora_dir=lora_dir, merge=True,
                                         progress=False)
      print(sorted(os.listdir(converted)))
      """),
      md("""
      ## 3. Load

      `d2f_jax.load_model` takes a converted directory or a Hugging Face one (it also accepts
      `lora_dir=` to merge an adapter at load time). It returns the model split into a static graph and a
      parameter state (what every jitted entry point takes), plus the tokenizer.
      """),
      code("""
      model = d2f_jax.load_model(converted)
      n_params = sum(x.size for x in jax.tree.leaves(model.state))
      print(model.config.family, f"{n_params / 1e6:.2f}M parameters,", model.config.num_layers, "layers")
      prompt = model.encode("w17 w42 w99 w7 w256 w3")
      print("prompt ids:", prompt)
      """),
      md("""
      ## 4. Generate with D2F

      `DecodeConfig` holds the paper's thresholds: a block is appended once the last one is `tau_add`
      decoded, a block becomes fully active once its predecessor is `tau_act` decoded, and a token is
      accepted when its confidence exceeds `tau_conf` (a fully active block that clears nothing accepts
      its single most confident token). The whole generation is one jitted `lax.while_loop`.
      """),
      code("""
      config = DecodeConfig(method="d2f", block_size=8, max_new_tokens=64, tau_add=0.25, tau_act=0.75,
                            tau_conf=0.9, stop_ids=())
      result = generate(model, [prompt], config)
      tokens = result.to_lists()[0]
      forwards = int(result.forwards[0])
      print(f"{len(tokens)} tokens in {forwards} forwards ({len(tokens) / forwards:.2f} tokens per forward), "
            f"at most {int(result.max_in_flight[0])} blocks in flight")
      print(model.decode(tokens)[:120], "...")
      vanilla = generate(model, [prompt], config.replace(method="vanilla"))
      print("vanilla LLaDA decoding (one token per forward, no cache):", int(vanilla.forwards[0]), "forwards")
      """),
      md("""
      ## 5. The trace picture

      `DecodeResult.trace[b, i]` is the step (forward) at which response position `i` was accepted. Each
      block forms a staircase; staircases of consecutive blocks overlap in time: that is the pipelining.
      With random weights no token is confident, so each active block accepts one token per step; a
      trained D2F student accepts several (see `pipeline_visualisation.ipynb`).
      """),
      code("""
      trace = np.asarray(result.trace[0])
      positions = np.arange(trace.size)
      blocks = positions // config.block_size
      fig, ax = plt.subplots(figsize=(9, 4))
      for b in np.unique(blocks):
          sel = blocks == b
          ax.scatter(positions[sel], trace[sel], s=18, label=f"block {b}")
          ax.axvspan(b * config.block_size - 0.5, (b + 1) * config.block_size - 0.5, alpha=0.06 * (b % 2 + 1),
                     color="gray")
      ax.set_xlabel("response position")
      ax.set_ylabel("step at which the token was accepted")
      ax.set_title(f"D2F decoding: {len(tokens)} tokens in {forwards} forwards")
      ax.legend(ncol=4, fontsize=8)
      plt.tight_layout()
      plt.show()
      """),
  ])


# --- distillation ------------------------------------------------------------------------------------

def distill_tiny() -> nbformat.NotebookNode:
  return notebook("distill_tiny", [
      md(f"""
      {badge("distill_tiny")}

      # Distilling a D2F student (tiny, on CPU)

      D2F's asymmetric distillation: one noised sequence goes to a frozen **bidirectional teacher** and a
      **block-causal student** (teacher + LoRA); later blocks are noisier than earlier ones (monotone
      schedule), and the student learns the teacher's distribution on the masked positions. This notebook
      runs `configs/tiny.py` (a random tiny LLaDA and synthetic question/answer pairs, written on the fly)
      for a few steps with the `Trainer` API, plots the loss, exports the PEFT adapter and loads it back.
      The same code path trains LLaDA-8B on a pod:

      ```bash
      python -m d2f_jax.distill --config configs/llada_8b.py:tpu_v5p_64 --workdir /mnt/runs/llada \\
          --config.model.path=/ckpt/LLaDA-8B-Instruct --config.data.path=/data/qa.jsonl
      ```
      """),
      code(INSTALL),
      code("""
      import json, subprocess, tempfile
      import jax
      import matplotlib.pyplot as plt
      import numpy as np
      from flax import nnx
      from d2f_jax.decode import DecodeConfig, generate
      from d2f_jax.models import logits_for_mode
      from d2f_jax.train.config import load_config_file
      from d2f_jax.train.trainer import Trainer


      def repo_file(relative):
          \"\"\"A file of the repository (configs/ is not part of the pip package): from this checkout, or cloned.\"\"\"
          package_root = os.path.dirname(os.path.dirname(os.path.abspath(d2f_jax.__file__)))
          for base in (os.getcwd(), os.path.dirname(os.getcwd()), package_root):
              if os.path.isfile(os.path.join(base, relative)):
                  return os.path.join(base, relative)
          clone = os.path.join(tempfile.gettempdir(), "d2f_jax_src")
          if not os.path.isdir(clone):
              subprocess.run(["git", "clone", "-q", "--depth", "1", "__REPO__", clone], check=True)
          return os.path.join(clone, relative)


      WORK = tempfile.mkdtemp(prefix="d2f_distill_")
      """.replace("__REPO__", REPO)),
      md("""
      ## 1. The config

      `configs/tiny.py` is an ordinary config file (`get_config(arg)` building on the defaults); we shorten
      the run to 40 steps and log every other step. Anything can be overridden the same way on the command
      line (`--config.total_steps=40`).
      """),
      code("""
      config = load_config_file(repo_file("configs/tiny.py"))
      config.total_steps = 40
      config.log_every = 2
      config.eval_every = 20
      config.eval_batches = 2
      config.data.synthetic_examples = 256
      config.data.eval_examples = 16
      config.checkpoint.every = 40
      config.progress_bar = False
      print(f"model {config.model.preset} ({config.finetune}, LoRA r{config.lora.rank} on "
            f"{tuple(config.lora.targets)}), block {config.block_size}, batch {config.batch_size} x "
            f"{config.data.seq_len} tokens, lr {config.optim.lr}")
      """),
      md("""
      ## 2. Train

      `Trainer(config, workdir)` writes the synthetic checkpoint and data into the workdir, builds the mesh
      (one CPU device here), places teacher weights and the LoRA state on it, and `run()` trains to
      `total_steps`, checkpointing (a rerun resumes) and exporting the adapter at the end.
      """),
      code("""
      trainer = Trainer(config, WORK)
      history = trainer.run()
      train = [h for h in history if "loss" in h]
      evals = [h for h in history if "eval_loss" in h]
      print(f"{len(train)} logged steps; eval KL(teacher || student): {evals[0]['eval_kl']:.4f} at step 0 -> "
            f"{evals[-1]['eval_kl']:.4f} at step {evals[-1]['step']}")
      """),
      md("""
      ## 3. The loss

      The loss is the cross-entropy of the student against the teacher's softmax on masked response
      positions, weighted by 1/p (p = the block's mask ratio). It equals KL(teacher || student) plus the
      teacher's entropy, so the KL is what training can drive to zero.
      """),
      code("""
      fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
      steps = [h["step"] for h in train]
      ax1.plot(steps, [h["loss"] for h in train], marker=".", label="train")
      ax1.plot([h["step"] for h in evals], [h["eval_loss"] for h in evals], "o--", label="held out")
      ax1.set_title("distillation loss (CE vs teacher)")
      ax2.plot(steps, [h["kl"] for h in train], marker=".", label="train")
      ax2.plot([h["step"] for h in evals], [h["eval_kl"] for h in evals], "o--", label="held out")
      ax2.set_title("KL(teacher || student)")
      for ax in (ax1, ax2):
          ax.set_xlabel("step")
          ax.legend()
      plt.tight_layout()
      plt.show()
      """),
      md("""
      ## 4. Export the adapter and load it back

      The student leaves as a PEFT adapter, the format of the released D2F students, so PyTorch / PEFT can
      load it as well. `d2f_jax.load_model(base, lora_dir=adapter)` merges it into the base weights; the
      reloaded student must give the trained student's logits.
      """),
      code("""
      adapter = trainer.export(os.path.join(WORK, "exported_adapter"))
      print(sorted(os.listdir(adapter)))
      print({k: v for k, v in json.load(open(os.path.join(adapter, "adapter_config.json"))).items()
             if k in ("peft_type", "r", "lora_alpha", "target_modules")})

      student = d2f_jax.load_model(trainer.model_path, lora_dir=adapter)  # merged
      teacher = d2f_jax.load_model(trainer.model_path)

      tokens = np.asarray([student.encode("w5 w6 w7 w8") + [student.config.mask_token_id] * 16])
      kw = dict(mode="block_causal", prompt_len=np.asarray([4]), block_size=config.block_size)
      reloaded = student.logits(tokens, **kw)
      _, trained = trainer.modules()
      graphdef, state = nnx.split(trained)
      in_trainer = logits_for_mode(graphdef, state, tokens, np.ones_like(tokens), **kw)
      print("max |reloaded - trained| logit difference:", float(np.abs(reloaded - in_trainer).max()))
      print("max |teacher - trained|  logit difference:",
            float(np.abs(teacher.logits(tokens, **kw) - in_trainer).max()))
      """),
      md("""
      ## 5. Decode with the student

      The reloaded student decodes like any model. (A 40-step toy distillation of a random teacher does not
      make a fast student; the point is that the exported artefact round-trips.)
      """),
      code("""
      decode = DecodeConfig(method="d2f", block_size=config.block_size, max_new_tokens=32, stop_ids=())
      prompt = student.encode("w5 w6 w7 w8")
      for name, m in (("teacher", teacher), ("student", student)):
          r = generate(m, [prompt], decode)
          print(f"{name}: {int(r.forwards[0])} forwards ->", m.decode(r.to_lists()[0])[:80])
      trainer.close()
      """),
  ])


# --- pipeline visualisation ----------------------------------------------------------------------------

def pipeline_visualisation() -> nbformat.NotebookNode:
  return notebook("pipeline_visualisation", [
      md(f"""
      {badge("pipeline_visualisation")}

      # Inside D2F's pipelined decoding

      D2F keeps several blocks in flight. Each step runs one forward over every block not yet in the KV
      cache, then per block:

      * **semi-activated** (its predecessor is less than `tau_act` decoded): accepts only tokens whose
        confidence exceeds `tau_conf`, possibly none;
      * **fully activated**: the same, but if nothing clears `tau_conf` it accepts its single most confident
        token;
      * **finished**: no masks left; it goes into the cache (its K/V written by the next forward) as soon as
        every earlier block is there;
      * a new block is **appended** when the last one is `tau_add` decoded.

      We decode one prompt, rebuild this schedule step by step from `DecodeResult.trace` (the step at which
      each position was accepted), and then sweep `tau_conf`.
      """),
      code(INSTALL),
      code("""
      import tempfile
      import jax
      import matplotlib.pyplot as plt
      import numpy as np
      from flax import nnx
      from matplotlib.colors import ListedColormap
      from d2f_jax.convert.synthetic import write_hf_checkpoint
      from d2f_jax.decode import DecodeConfig, generate, trace_count
      from d2f_jax.models import TINY_LLADA

      WORK = tempfile.mkdtemp(prefix="d2f_pipeline_")
      """),
      md("""
      ## 1. A model with confident predictions

      A random tiny LLaDA predicts nearly uniform distributions (top-1 probability about 1/vocabulary), so no
      token would ever clear a threshold. To see the thresholds at work without training, we sharpen its
      output: the LM head times 30 turns its logits into confident, position-dependent predictions,
      roughly like a trained model's. (With a real checkpoint, skip this cell's last lines.)
      """),
      code("""
      model = d2f_jax.load_model(write_hf_checkpoint(os.path.join(WORK, "hf"), TINY_LLADA, seed=0))
      params = nnx.to_pure_dict(model.state)
      params["lm_head"] = params["lm_head"] * 30.0
      nnx.replace_by_pure_dict(model.state, params)
      prompt = model.encode("w17 w42 w99 w7 w256 w3")
      """),
      md("""
      ## 2. Decode one prompt
      """),
      code("""
      config = DecodeConfig(method="d2f", block_size=8, max_new_tokens=48, max_blocks_in_flight=3,
                            tau_add=0.25, tau_act=0.75, tau_conf=0.9, stop_ids=())
      result = generate(model, [prompt], config)
      trace = np.asarray(result.trace[0])
      tokens = np.asarray(result.tokens[0])
      forwards = int(result.forwards[0])
      print(f"{trace.size} tokens in {forwards} forwards ({trace.size / forwards:.2f} per forward); "
            f"at most {int(result.max_in_flight[0])} blocks in flight, at most {int(result.max_accepted[0])} "
            f"tokens accepted in one step")
      """),
      md("""
      ## 3. Rebuild the schedule from the trace

      The trace says when each token was accepted; the rules above say the rest. `schedule` replays them: per
      step, the state of every block and how many tokens it accepted. The replay must agree with the
      decoder's own counters (steps, most blocks in flight), which the cell checks.
      """),
      code("""
      NOT_ADDED, SEMI, FULL, FINISHED, WRITING, CACHED = range(6)
      STATE_NAMES = ["not added", "semi-activated", "fully activated", "finished, waiting", "K/V being written",
                     "cached"]


      def needed(tau, block_size):
          \"\"\"Decoded tokens that reach ratio tau (the decoder compares counts, not ratios).\"\"\"
          return next(n for n in range(block_size + 1) if n / block_size >= tau)


      def schedule(trace, config):
          \"\"\"(states [steps, blocks], accepted [steps, blocks]) replayed from one row's trace.\"\"\"
          bs = config.block_size
          nb = config.max_new_tokens // bs
          add_count, act_count = needed(config.tau_add, bs), needed(config.tau_act, bs)
          steps = int(trace.max()) + 1
          states = np.full((steps, nb), NOT_ADDED)
          accepted = np.zeros((steps, nb), int)
          added, cached, pending = 1, 0, 0
          for t in range(steps):
              before = ((trace >= 0) & (trace < t)).reshape(nb, bs).sum(1)  # decoded before this step
              after = ((trace >= 0) & (trace <= t)).reshape(nb, bs).sum(1)
              accepted[t] = after - before
              for b in range(nb):
                  if b < cached:
                      states[t, b] = CACHED
                  elif b < cached + pending:
                      states[t, b] = WRITING
                  elif b < added:
                      if before[b] == bs:
                          states[t, b] = FINISHED
                      elif b == 0 or before[b - 1] >= act_count:
                          states[t, b] = FULL
                      else:
                          states[t, b] = SEMI
              # freeze the leading finished blocks, then append for the next step
              run = 0
              while cached + run < added and after[cached + run] == bs:
                  run += 1
              cached, pending = cached + pending, run - pending
              flying = added - cached - pending
              if added < nb and after[added - 1] >= add_count and flying < config.max_blocks_in_flight:
                  added += 1
          return states, accepted


      states, accepted = schedule(trace, config)
      in_flight = ((states == SEMI) | (states == FULL) | (states == FINISHED)).sum(1)
      assert len(states) == forwards, (len(states), forwards)
      assert in_flight.max() == int(result.max_in_flight[0])
      assert accepted.sum(1).max() == int(result.max_accepted[0])
      print("replay agrees with the decoder:", len(states), "steps, up to", in_flight.max(), "blocks in flight")
      """),
      md("""
      ## 4. Step by step
      """),
      code("""
      SHORT = {SEMI: "semi", FULL: "full", FINISHED: "done", WRITING: "kv", CACHED: "cache"}
      bs = config.block_size
      for t in range(len(states)):
          cells = []
          for b, s in enumerate(states[t]):
              if s == NOT_ADDED:
                  continue
              if s == CACHED:
                  cells.append(f"B{b}:cache")
                  continue
              decoded = int(((trace[b * bs:(b + 1) * bs] >= 0) & (trace[b * bs:(b + 1) * bs] <= t)).sum())
              cells.append(f"B{b}:{SHORT[s]} {decoded}/{bs}" + (f" +{accepted[t, b]}" if accepted[t, b] else ""))
          new = [model.decode([int(tokens[i])]) or str(int(tokens[i])) for i in np.flatnonzero(trace == t)]
          print(f"step {t:2d} | " + "  ".join(cells) + f"  | accepted: {' '.join(new)}")
      """),
      md("""
      ## 5. The picture

      Left: the state of every block at every step (numbers: tokens accepted in that step). Right: every
      response position, coloured from the step it was accepted on; several positions of several blocks
      flip in the same row whenever the pipeline is full.
      """),
      code("""
      colors = ["#f2f2f2", "#fdd49e", "#fc8d59", "#99d8c9", "#41ae76", "#9ecae1"]
      fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 5), gridspec_kw=dict(width_ratios=[1, 2]))
      ax1.imshow(states, cmap=ListedColormap(colors), vmin=-0.5, vmax=5.5, aspect="auto", interpolation="nearest")
      for (t, b), n in np.ndenumerate(accepted):
          if n:
              ax1.text(b, t, str(n), ha="center", va="center", fontsize=8)
      ax1.set_xlabel("block")
      ax1.set_ylabel("step")
      ax1.set_title("block states")
      handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors]
      ax1.legend(handles, STATE_NAMES, fontsize=7, loc="lower left", bbox_to_anchor=(0, -0.38), ncol=2)

      decoded = np.array([(trace >= 0) & (trace <= t) for t in range(len(states))], float)
      decoded[np.array([trace == t for t in range(len(states))])] = 2.0
      ax2.imshow(decoded, cmap=ListedColormap(["#f7f7f7", "#bdbdbd", "#d7301f"]), aspect="auto",
                 interpolation="nearest")
      for b in range(1, config.max_new_tokens // bs):
          ax2.axvline(b * bs - 0.5, color="k", lw=0.5)
      ax2.set_xlabel("response position (red: accepted in this step, grey: already decoded)")
      ax2.set_title("tokens")
      plt.tight_layout()
      plt.show()
      """),
      md("""
      ## 6. Tokens per forward vs `tau_conf`

      Lower thresholds accept more tokens per forward (faster, riskier); D2F's pipelining adds to what
      threshold decoding with one block at a time (`method="threshold"`: `tau_add = 1`, one block in flight,
      Fast-dLLM style) gets. Thresholds are traced values, so the whole sweep reuses one compiled program
      per method.
      """),
      code("""
      taus = [0.5, 0.7, 0.8, 0.85, 0.9, 0.95, 0.99]
      compiled_before = trace_count("loop")
      speed = {}
      for method in ("d2f", "threshold"):
          speed[method] = []
          for tau in taus:
              r = generate(model, [prompt], config.replace(method=method, tau_conf=tau))
              speed[method].append(config.max_new_tokens / int(r.forwards[0]))
      print("programs compiled for the sweep:", trace_count("loop") - compiled_before)
      fig, ax = plt.subplots(figsize=(6, 3.5))
      for method, values in speed.items():
          ax.plot(taus, values, "o-", label=method)
      ax.axhline(1.0, color="gray", ls=":", label="vanilla (1 token / forward)")
      ax.set_xlabel("tau_conf")
      ax.set_ylabel("tokens per forward")
      ax.legend()
      plt.tight_layout()
      plt.show()
      for method, values in speed.items():
          print(method, " ".join(f"{tau}: {v:.2f}" for tau, v in zip(taus, values)))
      """),
  ])


NOTEBOOKS = {"quickstart": quickstart, "distill_tiny": distill_tiny, "pipeline_visualisation": pipeline_visualisation}


def render(name: str) -> str:
  return nbformat.writes(NOTEBOOKS[name](), version=4) + "\n"


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--check", action="store_true", help="exit 1 if a notebook differs from what build.py writes")
  args = p.parse_args(argv)
  stale = []
  for name in NOTEBOOKS:
    path = os.path.join(HERE, f"{name}.ipynb")
    text = render(name)
    if args.check:
      if not os.path.isfile(path) or open(path).read() != text:
        stale.append(path)
      continue
    with open(path, "w") as f:
      f.write(text)
    print("wrote", path)
  if stale:
    print("out of date (run python notebooks/build.py):", *stale, sep="\n  ", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
