"""Where a model comes from, decided in one place: a converted (orbax) directory, a Hugging Face directory,
or a Hugging Face Hub id ("GSAI-ML/LLaDA-8B-Instruct", "org/name@revision") resolved to a snapshot of the
Hub cache.

Hub ids fetch only weights as safetensors, configs and tokenizer files (never `*.py` remote code, never
pickles); `HF_HUB_OFFLINE=1` keeps to the local cache (`HF_HUB_CACHE`, default ~/.cache/huggingface/hub),
which is how the tests and air-gapped pods use it. Everything that reads a model (load_model, the trainer,
aot) goes through `resolve_model_dir`, `read_model_config`, `load_params` and `load_tokenizer`.
"""

from __future__ import annotations

import os
import re
from typing import Any

from d2f_jax.convert.checkpoint import is_converted_dir, read_converted_meta, restore_converted
from d2f_jax.convert.hf_config import read_hf_config
from d2f_jax.convert.errors import ConvertError
from d2f_jax.convert.hf_import import load_hf_params
from d2f_jax.convert.pickle_io import find_pickles
from d2f_jax.convert.safetensors import find_safetensors
from d2f_jax.convert.util import missing_file_error
from d2f_jax.models import LoraConfig, ModelConfig

# owner/name[@revision]: the Hub's repo id rules (letters, digits, '-', '_', '.'), a revision without spaces.
HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
SNAPSHOT_FILES = ("*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja")


def hub_offline() -> bool:
  return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def resolve_model_dir(path_or_id, *, what: str = "model") -> str:
  """A local directory for `path_or_id`: the directory itself, or the Hub cache snapshot of a Hub id.

  what: how errors name the input ('model', 'config.model.path', '--model')."""
  text = os.fspath(path_or_id)
  if os.path.isdir(text):
    return text
  if os.path.exists(text):
    raise FileNotFoundError(f"{what} {text!r} is a file, not a model directory")
  if os.path.islink(text):  # a dangling link or a loop: say which, not "does not exist"
    raise missing_file_error(text, f"{what} directory")
  match = HUB_ID.match(text)
  if match is None or text.startswith((".", "~")):
    raise FileNotFoundError(f"{what} directory {text!r} does not exist")
  from huggingface_hub import snapshot_download  # a transformers dependency; only for Hub ids
  offline = hub_offline()
  try:
    return snapshot_download(match["repo"], revision=match["revision"], allow_patterns=list(SNAPSHOT_FILES),
                             cache_dir=os.environ.get("HF_HUB_CACHE") or None, local_files_only=offline)
  except Exception as e:  # not cached offline, unknown repo, no network: one message naming the id
    where = ("in the local Hugging Face cache (HF_HUB_OFFLINE is set; HF_HUB_CACHE="
             f"{os.environ.get('HF_HUB_CACHE', '~/.cache/huggingface/hub')})" if offline else "on the Hub")
    raise FileNotFoundError(f"{what} directory {text!r} does not exist, and as a Hugging Face Hub id it was not "
                            f"found {where}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e


FORMATS = ("converted", "hf")


def hf_weight_files(path: str) -> list[str]:
  """Names of the Hugging Face weight files in `path` (safetensors, else pickles)."""
  found = find_safetensors(path)
  return [os.path.basename(f) for f in (found[1] if found else find_pickles(path))]


def checkpoint_kind(path: str, format: str | None = None) -> str:  # noqa: A002 - the user-facing word
  """'converted' (d2f_model.json) or 'hf' (config.json); an error naming the directory otherwise.

  A directory holding both a converted model and Hugging Face weights is refused unless `format` says which
  to read: silently preferring one loaded a different model than the user may have meant."""
  if format is not None:
    if format not in FORMATS:
      raise ConvertError(f"format must be one of {FORMATS} or None, got {format!r}")
    return format
  if is_converted_dir(path):
    weights = hf_weight_files(path)
    if weights:
      raise ConvertError(f"{path!r} holds both a converted model (d2f_model.json) and a Hugging Face checkpoint "
                         f"({', '.join(weights[:3])}); say which to load: format='converted' or format='hf'")
    return "converted"
  if os.path.isfile(os.path.join(path, "config.json")):
    return "hf"
  raise FileNotFoundError(f"{path!r} holds neither a converted model (d2f_model.json) nor a Hugging Face "
                          "checkpoint (config.json)")


def read_model_config(path: str, format: str | None = None) -> tuple[ModelConfig, LoraConfig | None]:  # noqa: A002
  """(config, LoRA config or None) of a resolved model directory, without reading any weights."""
  if checkpoint_kind(path, format) == "converted":
    config, lora, _ = read_converted_meta(path)
    return config, lora
  return read_hf_config(path)[0], None


def load_params(path: str, dtype=None, *, target: Any = None, allow_pickle: bool = False, progress: bool = False,
                allow_nonfinite: bool = False, format: str | None = None,  # noqa: A002
                ) -> tuple[ModelConfig, Any, LoraConfig | None, Any]:
  """(config, params, LoRA config, LoRA params) of a resolved model directory.

  target: for a converted directory, the abstract tree with shardings that orbax restores straight into;
  an HF checkpoint is streamed to host numpy arrays (the caller places them). NaN / inf weights are refused
  (convert/finite.py) unless `allow_nonfinite`. format: 'converted' or 'hf' for a directory holding both.
  """
  if checkpoint_kind(path, format) == "converted":
    return restore_converted(path, dtype=dtype, target=target, allow_nonfinite=allow_nonfinite)
  config, params = load_hf_params(path, dtype=dtype, allow_pickle=allow_pickle, progress=progress,
                                  allow_nonfinite=allow_nonfinite)
  return config, params, None, None


def load_tokenizer(path: str):
  """The HF tokenizer saved in `path`, read locally only; None when the directory has none.

  With a `tokenizer.json` (LLaDA and Dream both ship one) the fast tokenizer is built directly, so
  Dream's remote-code tokenizer class is never imported or executed.
  """
  if not any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES):
    return None
  import transformers  # heavy; only when a tokenizer is present
  try:
    if os.path.exists(os.path.join(path, "tokenizer.json")):
      return transformers.PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
  except Exception as e:  # surface which directory failed and why, not a hub lookup trace
    raise ValueError(f"could not load the tokenizer in {path!r}: {e}") from e
