"""`d2f_jax` as an lm-evaluation-harness model, so scores follow the protocol published numbers used.

    python -m d2f_jax.evals.lm_eval_model --model d2f_jax \\
        --model_args pretrained=PATH,method=d2f,add_bos=True --tasks gsm8k_d2f \\
        --num_fewshot 4 --apply_chat_template --fewshot_as_multiturn --output_path results/lm_eval --log_samples

This module registers the model and then runs lm-eval's own command line (any lm-eval flag works; the
results JSON and samples files are lm-eval's). The project's task configs (gsm8k_d2f, gsm8k_builtin,
humaneval_d2f, on the local files of `d2f_jax.datafiles.data_dir()`) are on the include path unless
`--include_path` is given. `import d2f_jax.evals.lm_eval_model` is enough to use
`lm_eval.simple_evaluate(model="d2f_jax", ...)` from Python.

generate_until runs any decoding method of d2f_jax.decode (method=d2f|threshold|vanilla|ar|...), greedy
unless the request samples, cut at the request's `until` strings and capped at its max_gen_toks (the
decoder's block multiple above that is generated and dropped). A `mesh=data=1;tensor=8` model argument
(';' between axes, as model_args are comma-separated) loads the weights sharded over a device mesh and
decodes on it. loglikelihood and loglikelihood_rolling are the Monte Carlo ELBO of LLaDA's evaluation
(evals/lm_eval_elbo.py, `mc_samples` draws, exact for one-token continuations): a lower bound on the
log-likelihood, which is what a masked-diffusion model can give, so multiple-choice scores are comparable
with LLaDA's lm-eval numbers, not with autoregressive models' exact log-likelihoods.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import sys
import zlib

from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from d2f_jax.evals.engine_pass import engine_fits, run_engine
from d2f_jax.evals.lm_eval_elbo import masked_elbo

_DECODE_FIELDS = ("method", "block_size", "max_blocks_in_flight", "tau_add", "tau_act", "tau_conf", "temperature",
                  "top_p", "top_k", "steps", "alg", "prompt_buckets")


def cut_at_stops(text: str, until: list[str]) -> str:
  """`text` up to the first occurrence of any stop string (lm-eval's `until` semantics)."""
  cut = min((i for i in (text.find(s) for s in until if s) if i >= 0), default=len(text))
  return text[:cut]


class D2FJaxLM(LM):
  """lm-eval model over d2f_jax.load_model + d2f_jax.decode.generate.

  pretrained: HF or converted checkpoint directory (or pass `model`, a d2f_jax.Model, from Python).
  add_bos: prepend BOS to every context that does not start with it (the D2F authors' GSM8K setting).
  batch_size: contexts per generate call. The remaining keyword arguments are DecodeConfig fields.
  """

  def __init__(self, pretrained: str | None = None, *, model=None, dtype: str | None = None, lora: str | None = None,
               attention: str | None = None, mesh: str | None = None, add_bos: bool = False, batch_size=1,
               max_gen_toks: int = 512, seed: int = 0, stop_ids: str | None = None, mc_samples: int = 32,
               max_batch_size=None, device=None, **decode_options):
    super().__init__()
    import d2f_jax
    from d2f_jax.decode import DecodeConfig

    unknown = sorted(set(decode_options) - set(_DECODE_FIELDS))
    if unknown:
      raise ValueError(f"d2f_jax model_args: unknown option(s) {', '.join(unknown)}; decoding options are "
                       f"{', '.join(_DECODE_FIELDS)}")
    if (model is None) == (pretrained is None):
      raise ValueError("d2f_jax model_args: give exactly one of pretrained=PATH or model=d2f_jax.Model")
    self.batch_size = int(batch_size) if str(batch_size).isdigit() else 1
    if self.batch_size < 1:
      raise ValueError(f"d2f_jax: batch_size must be a positive int, got {batch_size!r}")
    self.max_gen_toks, self.add_bos, self.seed = int(max_gen_toks), bool(add_bos), int(seed)
    self.mc_samples = int(mc_samples)
    self.mesh = _make_mesh(mesh) if mesh else None
    if model is None:
      model = d2f_jax.load_model(str(pretrained), dtype=dtype, lora_dir=lora, attention=attention, mesh=self.mesh)
    elif self.mesh is not None:
      model = model.shard(self.mesh)
    self.model = model
    self.tokenizer = model.tokenizer
    if self.tokenizer is None:
      raise ValueError(f"d2f_jax: no tokenizer next to the checkpoint {model.source!r}")
    stop_ids = None
    if stop_ids is not None:
      text = str(stop_ids).strip().lower()
      stop_ids = () if text == "none" else tuple(int(t) for t in text.replace(";", ",").split(",") if t.strip())
    self.base_config = DecodeConfig(max_new_tokens=_round_up(self.max_gen_toks, decode_options.get(
        "block_size", DecodeConfig.block_size)), stop_ids=stop_ids, **decode_options)
    self.requests_seen: list[tuple[list[int], dict]] = []  # (prompt ids, generation settings), for tests

  # --- lm-eval interface ---------------------------------------------------------------------------
  @property
  def tokenizer_name(self) -> str:
    return str(getattr(self.tokenizer, "name_or_path", "") or self.model.source).replace("/", "__")

  def chat_template(self, chat_template: bool | str = False) -> str | None:
    if not chat_template:
      return None
    return chat_template if isinstance(chat_template, str) else getattr(self.tokenizer, "chat_template", None)

  def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    return self.tokenizer.apply_chat_template(chat_history, tokenize=False, add_generation_prompt=add_generation_prompt,
                                              continue_final_message=not add_generation_prompt)

  def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
    """(ELBO of the continuation given the context, whether greedy one-step decoding gives it), per request."""
    out = []
    for request in requests:
      context, continuation = request.args[0], request.args[1]
      prefix, target = self._encode_pair(context, continuation)
      value = masked_elbo(self.model, prefix, target, samples=self.mc_samples,
                          seed=self._request_seed(context, continuation))
      self.cache_hook.add_partial("loglikelihood", request.args, value)
      out.append(value)
    return out

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    """ELBO of each whole string after BOS (no windowing: the string must fit the model)."""
    bos = getattr(self.model.config, "bos_token_id", None)
    out = []
    for request in requests:
      text = request.args[0]
      target = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
      value, _ = masked_elbo(self.model, [] if bos is None else [bos], target, samples=self.mc_samples,
                             seed=self._request_seed("", text))
      self.cache_hook.add_partial("loglikelihood_rolling", request.args, value)
      out.append(value)
    return out

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    """One continuation per request. Requests with equal settings go through the continuous-batching engine
    with `batch_size` slots (d2f, threshold, ar at batch > 1: each request's greedy text is its batch-1 text),
    else in static batches of `batch_size`. A progress bar on stderr (process 0; off with disable_tqdm, which
    lm-eval passes) shows a long run alive."""
    import jax
    from tqdm.auto import tqdm

    settings = [self._settings(r.args[1] if len(r.args) > 1 else {}) for r in requests]
    prompts = [self._encode(r.args[0]) for r in requests]
    outputs: list[str | None] = [None] * len(requests)
    groups: dict[tuple, list[int]] = {}
    for i, (config, until, limit) in enumerate(settings):
      groups.setdefault((config, tuple(until), limit), []).append(i)
    with tqdm(total=len(requests), desc="generate_until", unit="request", file=sys.stderr,
              disable=disable_tqdm or jax.process_index() != 0) as bar:
      for (config, until, limit), rows in groups.items():
        if engine_fits(config, self.batch_size):
          texts = self._through_engine([prompts[i] for i in rows], config, limit, bar.update)
          for i, text in zip(rows, texts):
            outputs[i] = cut_at_stops(text, list(until))
            self.cache_hook.add_partial("generate_until", requests[i].args, outputs[i])
          continue
        for start in range(0, len(rows), self.batch_size):
          chunk = rows[start:start + self.batch_size]
          for i, text in zip(chunk, self._generate([prompts[i] for i in chunk], config, limit)):
            outputs[i] = cut_at_stops(text, list(until))
            self.cache_hook.add_partial("generate_until", requests[i].args, outputs[i])
          bar.update(len(chunk))
    return outputs

  # --- internals -----------------------------------------------------------------------------------
  def _settings(self, gen_kwargs: dict):
    """(DecodeConfig, stop strings, max tokens) of one request's generation kwargs."""
    kwargs = dict(gen_kwargs or {})
    until = kwargs.pop("until", None) or []
    until = [until] if isinstance(until, str) else list(until)
    limit = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
    if limit < 1:
      raise ValueError(f"d2f_jax: max_gen_toks must be positive, got {limit}")
    config = self.base_config
    do_sample = bool(kwargs.pop("do_sample", False))
    temperature = float(kwargs.pop("temperature", config.temperature if do_sample else 0.0))
    top_p = float(kwargs.pop("top_p", config.top_p))
    top_k = int(kwargs.pop("top_k", None) or config.top_k)  # HF's None / 0: off
    changes = {"max_new_tokens": _round_up(limit, config.block_size) if config.method != "ar" else limit,
               "temperature": temperature if do_sample or temperature > 0 else 0.0, "top_p": top_p, "top_k": top_k}
    ignored = sorted(set(kwargs) - {"num_beams", "repetition_penalty"})
    if ignored:
      print(f"d2f_jax: ignoring generation kwargs {ignored}", file=sys.stderr)
    return dataclasses.replace(config, **changes), until, limit

  def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Context and continuation ids; trailing spaces of the context move to the continuation (lm-eval)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
      context, continuation = context[:-spaces], context[-spaces:] + continuation
    prefix = self._encode(context) if context or self.add_bos else []
    whole = list(self.tokenizer(context + continuation, add_special_tokens=False)["input_ids"])
    head = prefix[1:] if self.add_bos and prefix and prefix[0] == self.model.config.bos_token_id else prefix
    if whole[:len(head)] == head:
      return prefix, whole[len(head):]
    return prefix, list(self.tokenizer(continuation, add_special_tokens=False)["input_ids"])

  def _request_seed(self, context: str, continuation: str) -> int:
    """A seed from the request's text, so its masks do not depend on lm-eval's request order."""
    return zlib.crc32(f"{self.seed}\x00{context}\x00{continuation}".encode()) ^ self.seed

  def _encode(self, context: str) -> list[int]:
    ids = list(self.tokenizer(context, add_special_tokens=False)["input_ids"])
    bos = getattr(self.model.config, "bos_token_id", None)
    if self.add_bos:
      if bos is None:
        raise ValueError("d2f_jax: add_bos=True but the model config has no bos_token_id")
      if not ids or ids[0] != bos:
        ids = [bos] + ids
    if not ids:
      raise ValueError("d2f_jax: a request's context encodes to no tokens")
    return ids

  def _generate(self, prompts: list[list[int]], config, limit: int) -> list[str]:
    import jax

    from d2f_jax.decode import generate
    from d2f_jax.evals.runner import decode_continuation

    kwargs = {}
    if self.mesh is not None and "mesh" in inspect.signature(generate).parameters:
      kwargs["mesh"] = self.mesh  # the model is already sharded there; passing it keeps the intent explicit
    for ids in prompts:
      self.requests_seen.append((ids, {"max_new_tokens": config.max_new_tokens, "limit": limit}))
    result = generate(self.model, prompts, config, key=jax.random.key(self.seed), **kwargs)
    return [decode_continuation(self.model, p, ids[:limit]) for p, ids in zip(prompts, result.to_lists())]

  def _through_engine(self, prompts: list[list[int]], config, limit: int, progress) -> list[str]:
    from d2f_jax.evals.runner import decode_continuation
    for ids in prompts:
      self.requests_seen.append((ids, {"max_new_tokens": config.max_new_tokens, "limit": limit}))
    run = run_engine(self.model, prompts, config, self.batch_size, warmup="none", progress=progress)
    return [decode_continuation(self.model, p, ids[:limit]) for p, ids in zip(prompts, run["tokens"])]


def _round_up(n: int, multiple: int) -> int:
  return -(-int(n) // multiple) * multiple


def _make_mesh(text: str):
  """A jax Mesh from 'data=1,tensor=8' (the --mesh syntax of generate / evaluate; ';' may stand for ',')."""
  import jax

  from d2f_jax import sharding
  return sharding.make_mesh(sharding.parse_mesh(text.replace(";", ",")), jax.devices())


TASKS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lm_eval_tasks")


def main(argv: list[str] | None = None) -> None:
  """lm-eval's command line with `d2f_jax` registered (this module is imported, which registers it)."""
  from lm_eval.__main__ import cli_evaluate
  argv = sys.argv[1:] if argv is None else list(argv)
  if "--include_path" not in argv:
    argv += ["--include_path", TASKS_DIR]
  saved = sys.argv
  sys.argv = ["lm-eval", *argv]
  try:
    cli_evaluate()
  finally:
    sys.argv = saved


if __name__ == "__main__":  # register and run the importable copy, so the class is registered once
  from d2f_jax.evals import lm_eval_model
  lm_eval_model.main()
else:
  register_model("d2f_jax")(D2FJaxLM)
