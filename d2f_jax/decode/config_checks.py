"""The checks of a DecodeConfig's fields, each failure a SettingError naming the field (a server names the
client's field from it); DecodeConfig runs them when it is made."""

from __future__ import annotations

import math
import numbers

from d2f_jax.decode.methods import METHODS

DREAM_ALGS: tuple[str, ...] = ("confidence", "entropy", "margin")
MAX_STOP_IDS = 8  # stop ids travel as a fixed-size traced array; -1 fills unused slots


def _is_number(value) -> bool:
  return isinstance(value, numbers.Real) and not isinstance(value, bool)


class SettingError(ValueError):
  """A decode setting that cannot be run; `.field` names it, so a server can name the client's field."""

  def __init__(self, field: str, message: str):
    super().__init__(f"DecodeConfig.{field} {message}")
    self.field = field


def check(config) -> None:
  """Refuse a DecodeConfig that cannot be run (SettingError naming the field)."""
  if config.method not in METHODS:
    raise SettingError("method", f"must be one of {METHODS}, got {config.method!r}")
  for name in ("block_size", "max_new_tokens", "max_blocks_in_flight"):
    value = getattr(config, name)
    if name == "max_blocks_in_flight" and value is None:
      continue
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
      raise SettingError(name, f"must be a positive int{' or None' if name[0] == 'm' else ''}, got {value!r}")
  if config.window_widths is not None:
    if (not isinstance(config.window_widths, tuple)
        or any(not isinstance(w, int) or isinstance(w, bool) or w <= 0 for w in config.window_widths)):
      raise SettingError("window_widths", f"must be None or a tuple of positive ints (blocks), "
                         f"got {config.window_widths!r}")
  if config.method != "ar" and config.max_new_tokens % config.block_size:
    raise SettingError("max_new_tokens", f"({config.max_new_tokens}) must be a multiple of "
                       f"block_size ({config.block_size})")
  for name in ("tau_add", "tau_act", "tau_conf"):
    value = getattr(config, name)
    if not _is_number(value) or not 0.0 <= value <= 1.0:
      raise SettingError(name, f"must lie in [0, 1], got {value!r}")
  if not _is_number(config.temperature) or not config.temperature >= 0.0 or math.isinf(config.temperature):
    raise SettingError("temperature", f"must be a finite number >= 0, got {config.temperature!r}")
  if not _is_number(config.top_p) or not 0.0 < config.top_p <= 1.0:
    raise SettingError("top_p", f"must lie in (0, 1], got {config.top_p!r}")
  if not isinstance(config.top_k, int) or isinstance(config.top_k, bool) or not 0 <= config.top_k < 2 ** 31:
    raise SettingError("top_k", f"must be an int in [0, 2**31) (0: off), got {config.top_k!r}")
  if config.alg not in DREAM_ALGS:
    raise SettingError("alg", f"must be one of {DREAM_ALGS}, got {config.alg!r}")
  if config.steps is not None:
    if not isinstance(config.steps, int) or config.steps <= 0:
      raise SettingError("steps", f"must be a positive int or None, got {config.steps!r}")
    if config.method == "vanilla":
      blocks = config.max_new_tokens // config.block_size
      if config.steps % blocks or config.steps // blocks > config.block_size:
        raise SettingError("steps", f"({config.steps}) must be a multiple of the number of blocks "
                           f"({blocks}) with at most block_size ({config.block_size}) steps per block")
  if config.stop_ids is not None:
    if len(config.stop_ids) > MAX_STOP_IDS or any(not isinstance(t, int) or isinstance(t, bool)
                                                or not 0 <= t < 2 ** 31 for t in config.stop_ids):
      raise SettingError("stop_ids", f"must be at most {MAX_STOP_IDS} non-negative ints, got {config.stop_ids!r}")
  budget = config.memory_budget_gib
  if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float))
                             or not math.isfinite(budget) or budget <= 0):
    raise SettingError("memory_budget_gib", f"must be a positive number of GiB or None, got {budget!r}")
  for name, value in (("query_limit", config.query_limit), ("position_budget", config.position_budget)):
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 2 ** 31):
      raise SettingError(name, f"must be a positive int or None, got {value!r}")
    if value is not None and config.method not in ("d2f", "threshold"):
      raise SettingError(name, f"is a mode of method 'd2f' / 'threshold', not {config.method!r}")
  if not isinstance(config.cache_decided, bool) or (config.cache_decided and config.method not in ("d2f", "threshold")):
    raise SettingError("cache_decided", f"must be a bool, True only for method 'd2f' / 'threshold', "
                       f"got {config.cache_decided!r} with method {config.method!r}")
  editing = config.editing_threshold
  if editing is not None and (not _is_number(editing) or not 0.0 <= editing <= 1.0 or config.method != "llada2"):
    raise SettingError("editing_threshold", f"must be None or lie in [0, 1], a setting of method 'llada2' (LLaDA2.1's "
                                            f"token editing), got {editing!r} with method {config.method!r}")
  if not isinstance(config.block_cache, bool) or (config.block_cache and config.method != "llada2"):
    raise SettingError("block_cache", f"must be a bool, True only for method 'llada2', got {config.block_cache!r} "
                                      f"with method {config.method!r}")
  post = config.max_post_steps
  if not isinstance(post, int) or isinstance(post, bool) or not 0 <= post < 2 ** 31:
    raise SettingError("max_post_steps", f"must be an int in [0, 2**31), got {post!r}")
  sample = config.sample
  if sample is not None and not isinstance(sample, bool) or sample is False and config.temperature > 0:
    raise SettingError("sample", f"must be None or a bool, and not False with temperature > 0, got "
                       f"{config.sample!r} (temperature {config.temperature!r})")
  buckets = (config.prompt_buckets,) if isinstance(config.prompt_buckets, int) else tuple(config.prompt_buckets)
  if not buckets or any(not isinstance(b, int) or b <= 0 for b in buckets):
    raise SettingError("prompt_buckets", f"must be a positive int or a tuple of them, "
                       f"got {config.prompt_buckets!r}")
