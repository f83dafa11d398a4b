"""LLaDA2 against the released checkpoints' own remote code: logits and `generate`, token for token.

Outside the suite (it needs that code and the transformers it was written for, 4.5x):

  python tests/llada2_remote_parity.py --remote_code DIR

DIR holds `modeling_llada2_moe.py` and `configuration_llada2_moe.py`: a Hub snapshot of a LLaDA2 checkpoint
(e.g. inclusionAI/LLaDA2.0-mini-preview) or dFactory's `models/llada2_moe` (whose training imports, veomni and
liger, are stood in for by the eager paths it has beside them). The script writes the project's tiny random
checkpoint in the released format, loads it in both, and checks
  1. float32 logits under the released block-diffusion mask within 1e-4, for several lengths and blocks;
  2. the remote `generate` (greedy) against `method="llada2"` token for token, over prompts ending inside a
     block and on its boundary, thresholds and step counts, and a stop id met mid-answer.
It prints one line per case and exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import logging
import pathlib
import sys
import tempfile
import types

import numpy as np

TOL = 1e-4


def _stand_in_for_training_imports() -> None:
  """dFactory's copy imports its trainer's package for a fused kernel and logging it does not use in eager
  inference; stand-ins let that copy run as the Hub's does."""
  if importlib.util.find_spec("veomni") is not None:
    return

  class _Logger(logging.Logger):
    def info_rank0(self, *args, **kwargs):
      pass

    warning_rank0 = warning_once = info_rank0

  def module(name, **attrs):
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    sys.modules[name] = m

  module("veomni")
  module("veomni.ops", causallm_loss_function=None, fused_moe_forward=None)
  module("veomni.distributed")
  module("veomni.distributed.parallel_state", get_parallel_state=lambda: types.SimpleNamespace(ep_enabled=False))
  module("veomni.utils", logging=types.SimpleNamespace(get_logger=_Logger))
  module("veomni.utils.import_utils", is_liger_kernel_available=lambda: False)


def load_remote(remote_code: pathlib.Path, hf_dir: pathlib.Path, lm_head_scale: float):
  """The remote LLaDA2MoeModelLM on the checkpoint's tensors: float32, SDPA attention (as the Hub loads it),
  eval mode."""
  import torch
  from safetensors.torch import load_file
  for name in ("modeling_llada2_moe.py", "configuration_llada2_moe.py"):
    if not (remote_code / name).is_file():
      raise SystemExit(f"--remote_code {remote_code}: no {name} there")
  package = pathlib.Path(tempfile.mkdtemp()) / "llada2_remote"
  package.mkdir()
  for f in remote_code.glob("*.py"):
    (package / f.name).write_text(f.read_text())
  (package / "__init__.py").write_text("")
  sys.path.insert(0, str(package.parent))
  _stand_in_for_training_imports()
  try:
    modeling = importlib.import_module("llada2_remote.modeling_llada2_moe")
  except ImportError as e:
    import transformers
    raise SystemExit(f"the remote code does not import under transformers {transformers.__version__} ({e}); "
                     "run this script where transformers 4.5x is installed") from e
  config_module = importlib.import_module("llada2_remote.configuration_llada2_moe")
  fields = json.loads((hf_dir / "config.json").read_text())
  config = config_module.LLaDA2MoeConfig(**fields)
  config._attn_implementation = "sdpa"  # the released generate passes an additive 0 / -inf mask, as SDPA takes it
  model = modeling.LLaDA2MoeModelLM(config).float().eval()
  tensors = load_file(str(hf_dir / "model.safetensors"))
  tensors["lm_head.weight"] = tensors["lm_head.weight"] * lm_head_scale
  missing, unexpected = model.load_state_dict(tensors, strict=False)
  buffers = {n for n, _ in model.named_buffers()}
  missing = [m for m in missing if m not in buffers or not m.endswith("expert_bias")]
  if missing or unexpected:
    raise SystemExit(f"the checkpoint and the remote model disagree: missing {missing}, unexpected {unexpected}")
  for name, buf in model.named_buffers():  # expert_bias is a buffer the remote state dict may or may not carry
    if name in tensors:
      buf.copy_(tensors[name])
  def float_mask(module, args, kwargs):
    # generate builds its 0 / -inf mask in bfloat16 (the released weights' dtype); SDPA wants the queries'
    # dtype, float32 here. 0 and -inf are exact in both.
    mask = kwargs.get("attention_mask")
    if mask is not None and mask.is_floating_point():
      kwargs["attention_mask"] = mask.float()
    return args, kwargs
  model.model.register_forward_pre_hook(float_mask, with_kwargs=True)
  if "argmax" not in inspect.getsource(type(model)._sample_with_temperature_topk_topp):
    # dFactory's training copy samples even at temperature 0; the Hub copy's greedy path is argmax with its
    # softmax probability as the confidence, which is what greedy decoding means for both.
    def greedy(self, logits, temperature=0.0, top_k=None, top_p=None):
      probs = torch.softmax(logits, dim=-1)
      token = logits.argmax(dim=-1, keepdim=True)
      return token.squeeze(-1), probs.gather(-1, token).squeeze(-1)
    type(model)._sample_with_temperature_topk_topp = greedy
  return model


def remote_logits(model, tokens: np.ndarray, block: int) -> np.ndarray:
  """Logits [T, V] under the released generate's mask: key visible iff its block <= the query's."""
  import torch
  n = len(tokens)
  blocks = np.arange(n) // block
  visible = torch.from_numpy(blocks[None, :] <= blocks[:, None])
  mask = torch.where(visible, 0.0, float("-inf"))[None, None]
  with torch.no_grad():
    out = model(torch.from_numpy(tokens[None]).long(), attention_mask=mask,
                position_ids=torch.arange(n)[None]).logits
  return out[0].float().numpy()


def project_logits(model, tokens: np.ndarray, block: int) -> np.ndarray:
  import jax.numpy as jnp
  from d2f_jax.models import forward
  positions = jnp.arange(len(tokens), dtype=jnp.int32)[None]
  logits, _ = forward(model.graphdef, model.state, jnp.asarray(tokens)[None], positions, positions // block)
  return np.asarray(logits[0])


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--remote_code", required=True, type=pathlib.Path)
  parser.add_argument("--lm_head_scale", type=float, default=4.0,
                      help="sharpen the random head so greedy confidences spread over (0, 1) as a trained one's")
  args = parser.parse_args(argv)

  import d2f_jax
  from d2f_jax.convert import synthetic
  from d2f_jax.decode import DecodeConfig, generate
  from d2f_jax.models.config import TINY_LLADA2
  hf_dir = pathlib.Path(tempfile.mkdtemp()) / "tiny-llada2"
  synthetic.write_hf_checkpoint(hf_dir, TINY_LLADA2, seed=3, dtype="float32", tokenizer=False)
  remote = load_remote(args.remote_code, hf_dir, args.lm_head_scale)
  ours = d2f_jax.load_model(str(hf_dir))
  head = ours.state["lm_head"]
  head[...] = head[...] * args.lm_head_scale
  config = ours.config

  failures = 0
  rng = np.random.default_rng(0)
  for length, block in [(21, 8), (32, 8), (37, 4), (16, 32)]:
    tokens = rng.integers(0, config.mask_token_id, size=length)
    diff = float(np.abs(project_logits(ours, tokens, block) - remote_logits(remote, tokens, block)).max())
    ok = diff <= TOL
    failures += not ok
    print(f"logits   length {length:3d} block {block:2d}: max |diff| {diff:.2e} {'ok' if ok else 'MISMATCH'}")

  import torch
  prompts = [[11, 23, 5, 101, 7], [3, 14, 15, 92, 65, 35, 89, 79], [5, 6, 7, 8, 9, 10, 11, 12, 13]]
  stop, seen = None, []  # the random model never picks its eos; the token it decodes most often stands in
  for block, gen, steps, threshold in [(8, 24, 8, 0.95), (8, 24, 4, 0.5), (4, 16, 2, 0.3), (8, 16, 8, 0.0),
                                       (8, 24, 8, 0.95), (4, 16, 2, 0.3)]:
    eos = config.eos_token_id if stop is None else stop
    decode = DecodeConfig(method="llada2", block_size=block, max_new_tokens=gen, steps=steps, tau_conf=threshold,
                          prompt_buckets=16, stop_ids=(eos,))
    result = generate(ours, prompts, decode)
    for row, prompt in enumerate(prompts):
      want = remote.generate(torch.tensor([prompt]), temperature=0.0, block_length=block, steps=steps,
                             gen_length=gen, threshold=threshold, eos_id=eos, mask_id=config.mask_token_id)[0].tolist()
      got = np.asarray(result.tokens[row, :int(result.lengths[row])]).tolist()
      ok = got == want
      failures += not ok
      print(f"generate block {block} gen {gen} steps {steps} threshold {threshold} stop {eos} prompt {len(prompt)}: "
            f"{len(got)} tokens {'ok' if ok else f'MISMATCH ours {got} remote {want}'}")
      seen += want
      if stop is None and row == len(prompts) - 1 and block == 4:
        stop = int(np.bincount(seen).argmax())  # the next cases stop on it
  print("all cases agree" if not failures else f"{failures} case(s) disagree")
  return 1 if failures else 0


if __name__ == "__main__":
  sys.exit(main())
