"""Plain step-by-step reference decoders, written from the spec, for one prompt at a time.

No cache, no windows, no jit of the loop: every step recomputes the model on the whole sequence
(prompt + the full response area) under the method's attention pattern and applies the rules in
Python/numpy. Blocks that are not appended yet are mask tokens in a later block, which block-causal
attention hides from every earlier block, so including them changes no logit that is used. The sequence
is right-padded to a fixed length so one compiled forward serves every step.

Greedy only. Each function returns dict(tokens, length, forwards, trace, and d2f diagnostics).
"""

from __future__ import annotations

import numpy as np
import jax.numpy as jnp

from d2f_jax.models import PAD_ID, forward, logits_for_mode

REF_LEN = 64  # fixed model input length (prompt + response must fit)


def _logits(model, seq: np.ndarray, mode: str, prompt_len: int | None = None, block_size: int | None = None,
            align: bool = True) -> np.ndarray:
  """Logits [len(seq), V] of the sequence under `mode`; row i predicts token i when `align`."""
  n = len(seq)
  if n > REF_LEN:
    raise ValueError(f"reference sequence of {n} tokens exceeds REF_LEN={REF_LEN}")
  tokens = np.full((1, REF_LEN), model.config.pad_token_id, np.int32)
  tokens[0, :n] = seq
  mask = np.zeros((1, REF_LEN), np.int32)
  mask[0, :n] = 1
  out = logits_for_mode(model.graphdef, model.state, jnp.asarray(tokens), jnp.asarray(mask), mode=mode,
                        prompt_len=prompt_len, block_size=block_size, align=align)
  return np.asarray(out[0, :n], np.float32)


def _fed_logits(model, seq: np.ndarray, fed: list[int], p: int, bs: int) -> dict[int, np.ndarray]:
  """Raw output rows {position: [V]} of a block-causal forward over the prompt and the positions `fed`
  only (the rest of the sequence is left out, not masked), each at its own position."""
  keep = list(range(p)) + sorted(fed)
  if len(keep) > REF_LEN:
    raise ValueError(f"reference sequence of {len(keep)} tokens exceeds REF_LEN={REF_LEN}")
  tokens = np.full((1, REF_LEN), model.config.pad_token_id, np.int32)
  positions = np.zeros((1, REF_LEN), np.int32)
  ids = np.full((1, REF_LEN), PAD_ID, np.int32)
  for i, pos in enumerate(keep):
    tokens[0, i], positions[0, i], ids[0, i] = seq[pos], pos, -1 if pos < p else (pos - p) // bs
  raw, _ = forward(model.graphdef, model.state, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(ids))
  raw = np.asarray(raw[0], np.float32)
  return {pos: raw[i] for i, pos in enumerate(keep)}


def _fed(seq, states, p, bs, mask_id, query_limit, config) -> tuple[list[int], list[int]]:
  """(fed, candidates) of a query-limited step: of each appended block, its decided positions and first
  `query_limit` masks (finished blocks: all of it), plus, for shifted logits, the position before each mask
  it may accept; the candidates are those masks."""
  fed, candidates = [], []
  for j, _ in enumerate(states):
    block = range(p + j * bs, p + (j + 1) * bs)
    masks = [i for i in block if seq[i] == mask_id]
    candidates += masks[:query_limit]
    fed += [i for i in block if seq[i] != mask_id] + masks[:query_limit]
  if config.logit_shift:
    fed += [i - 1 for i in candidates if i - 1 >= p]  # the prompt is always there
  return sorted(set(fed)), candidates


def _fed_count(seq, states, p, bs, mask_id, query_limit, config, window_start) -> int:
  """Positions the decoder's window feeds: those of the blocks from `window_start` (the first block that was
  not cached when the step began: the finished ones it caches now are fed whole) on."""
  fed, _ = _fed(seq, states, p, bs, mask_id, query_limit, config)
  return sum(i >= p + window_start * bs for i in fed)


def _query_probs(model, seq, states, p, bs, mask_id, query_limit) -> dict[int, np.ndarray]:
  """Probabilities {position: [V]} of the positions a query-limited step may accept (`_fed`)."""
  fed, candidates = _fed(seq, states, p, bs, mask_id, query_limit, model.config)
  raw = _fed_logits(model, seq, fed, p, bs)
  shift = 1 if model.config.logit_shift else 0
  return {i: _softmax(raw[i - shift][None])[0] for i in candidates}


def _softmax(logits: np.ndarray) -> np.ndarray:
  z = logits - logits.max(-1, keepdims=True)
  e = np.exp(z)
  return e / e.sum(-1, keepdims=True)


def _finish(response: np.ndarray, trace: np.ndarray, stops, pad_id: int, forwards: int, **extra) -> dict:
  length = len(response)
  for i, tok in enumerate(response):
    if int(tok) in stops:
      length = i + 1
      break
  tokens = np.where(np.arange(len(response)) < length, response, pad_id)
  return dict(tokens=tokens, length=length, forwards=forwards, trace=trace, **extra)


def d2f(model, prompt, *, block_size, max_new_tokens, max_blocks_in_flight, tau_add, tau_act, tau_conf,
        stop_ids, query_limit=None, position_budget=None) -> dict:
  """D2F pipelined decoding (spec section 4) with full block-causal recompute every step.
  max_blocks_in_flight: None = no cap (the authors' loop). query_limit: a block in flight feeds its decided
  positions and only its first `query_limit` masks (DecodeConfig.query_limit); the forward then holds the
  prompt, the finished blocks and those positions only. position_budget: each step's q is the largest of
  block_size, block_size / 2, ... 1 (at most query_limit) whose fed positions fit the budget (1 if none)."""
  if position_budget is not None and query_limit is None:
    query_limit = block_size
  cfg = model.config
  mask_id, bs = cfg.mask_token_id, block_size
  p = len(prompt)
  num_blocks = max_new_tokens // bs
  seq = np.array(list(prompt) + [mask_id] * max_new_tokens, np.int64)
  trace = np.full(max_new_tokens, -1)
  states: list[str] = []  # per appended block: 'active' | 'to_cache' | 'cached'
  eos = False
  forwards = 0
  max_in_flight = semi_steps = max_accepted = in_flight_sum = window_sum = 0

  def block(j):
    return slice(p + j * bs, p + (j + 1) * bs)

  def decoded(j):
    return int(np.sum(seq[block(j)] != mask_id))

  while forwards < max_new_tokens + 2:
    # A position whose argmax is the mask token stays masked, so the rules alone need not end (a random
    # model can prefer the mask id); the jitted loop's bound of max_new_tokens + 2 steps ends it the same way.
    # 1. append a block
    last_ratio = 1.0 if not states else decoded(len(states) - 1) / bs
    active = sum(s == "active" for s in states)
    room = max_blocks_in_flight is None or active < max_blocks_in_flight
    if len(states) < num_blocks and not eos and last_ratio >= tau_add and room:
      states.append("active")
    # 6. stop when no masks remain
    if not any(decoded(j) < bs for j in range(len(states))):
      break
    # 5. blocks finished last step get their final K/V in this forward
    window = sum(s in ("to_cache", "active") for s in states)  # blocks this forward computes
    window_start = sum(s == "cached" for s in states)  # the decoder's window: from the first not cached
    states = ["cached" if s == "to_cache" else s for s in states]
    # activation from the decoded ratio of the previous block (the prompt counts as complete)
    fully = [j == 0 or decoded(j - 1) / bs >= tau_act for j in range(len(states))]
    # 2. one forward over everything
    q = query_limit  # None: every mask of a block is a candidate
    if query_limit is None:
      probs = _softmax(_logits(model, seq, "block_causal", prompt_len=p, block_size=bs))
    else:  # the cached blocks are in the sequence (their K/V is the same recomputed); live ones are cut
      if position_budget is not None and forwards > 0:  # steps only: the first forward is the prefill's
        rungs = [bs >> k for k in range(bs.bit_length())]  # bs, bs / 2, ..., 1
        fits = [r for r in rungs if _fed_count(seq, states, p, bs, mask_id, min(query_limit, r), cfg,
                                               window_start) <= position_budget]
        q = min(query_limit, fits[0] if fits else 1)
      probs = _query_probs(model, seq, states, p, bs, mask_id, q)
    forwards += 1
    step = forwards - 1
    in_flight = [j for j, s in enumerate(states) if s == "active"]
    max_in_flight = max(max_in_flight, len(in_flight))
    in_flight_sum += len(in_flight)
    window_sum += window
    semi_steps += any(not fully[j] and decoded(j) < bs for j in in_flight)
    # 3. accept per block in flight
    accepted = []
    for j in in_flight:
      positions = [i for i in range(block(j).start, block(j).stop) if seq[i] == mask_id][:q]
      if not positions:
        continue
      choice = {i: int(np.argmax(probs[i])) for i in positions}
      conf = {i: float(probs[i][choice[i]]) for i in positions}
      chosen = [i for i in positions if conf[i] > np.float32(tau_conf)]
      if not chosen and fully[j]:
        chosen = [max(positions, key=lambda i: (conf[i], -i))]  # most confident, first on ties
      accepted += [(i, choice[i]) for i in chosen]
    for i, tok in accepted:
      seq[i] = tok
      trace[i - p] = step
      # 4. a stop token ends appending
      eos = eos or tok in stop_ids
    max_accepted = max(max_accepted, len(accepted))
    # 5. finished blocks freeze in order, only after every earlier block
    for j, s in enumerate(states):
      if s == "active" and decoded(j) == bs and all(t != "active" for t in states[:j]):
        states[j] = "to_cache"
  return _finish(seq[p:], trace, stop_ids, cfg.pad_token_id, forwards, max_in_flight=max_in_flight,
                 semi_steps=semi_steps, max_accepted=max_accepted, in_flight_sum=in_flight_sum,
                 window_sum=window_sum)


def llada_vanilla(model, prompt, *, block_size, max_new_tokens, steps, stop_ids) -> dict:
  """LLaDA semi-autoregressive low-confidence remasking: bidirectional, fixed steps per block."""
  cfg = model.config
  p = len(prompt)
  seq = np.array(list(prompt) + [cfg.mask_token_id] * max_new_tokens, np.int64)
  trace = np.full(max_new_tokens, -1)
  num_blocks = max_new_tokens // block_size
  per_block = steps // num_blocks
  forwards = 0
  for b in range(num_blocks):
    counts = [block_size // per_block + (s < block_size % per_block) for s in range(per_block)]
    for k in counts:
      probs = _softmax(_logits(model, seq, "bidirectional"))
      forwards += 1
      lo, hi = p + b * block_size, p + (b + 1) * block_size
      masked = [i for i in range(lo, hi) if seq[i] == cfg.mask_token_id]
      conf = {i: probs[i].max() for i in masked}
      for i in sorted(masked, key=lambda i: (-conf[i], i))[:k]:
        seq[i] = int(np.argmax(probs[i]))
        trace[i - p] = forwards - 1
  return _finish(seq[p:], trace, stop_ids, cfg.pad_token_id, forwards)


def dream_vanilla(model, prompt, *, max_new_tokens, steps, alg, stop_ids) -> dict:
  """Dream's diffusion decoding over the whole response, ordered by confidence / margin / -entropy."""
  cfg = model.config
  p = len(prompt)
  seq = np.array(list(prompt) + [cfg.mask_token_id] * max_new_tokens, np.int64)
  trace = np.full(max_new_tokens, -1)
  times = np.linspace(1, 1e-3, steps + 1)
  for i in range(steps):
    probs = _softmax(_logits(model, seq, "bidirectional"))
    masked = [j for j in range(p, len(seq)) if seq[j] == cfg.mask_token_id]
    k = len(masked) if i == steps - 1 else int(len(masked) * (1 - times[i + 1] / times[i]))
    score = {}
    for j in masked:
      top = np.sort(probs[j])[::-1]
      if alg == "confidence":
        score[j] = top[0]
      elif alg == "margin":
        score[j] = top[0] - top[1]
      else:
        nz = probs[j][probs[j] > 0]
        score[j] = float(np.sum(nz * np.log(nz)))
    for j in sorted(masked, key=lambda j: (-score[j], j))[:k]:
      seq[j] = int(np.argmax(probs[j]))
      trace[j - p] = i
  return _finish(seq[p:], trace, stop_ids, cfg.pad_token_id, steps)


def causal_greedy(model, prompt, *, max_new_tokens, stop_ids) -> dict:
  """Greedy next-token decoding recomputing the causal model over the whole sequence every token."""
  cfg = model.config
  seq = list(prompt)
  for _ in range(max_new_tokens):
    logits = _logits(model, np.array(seq), "causal", align=False)
    seq.append(int(np.argmax(logits[-1])))
    if seq[-1] in stop_ids:
      break
  response = np.array(seq[len(prompt):] + [cfg.pad_token_id] * (max_new_tokens - len(seq) + len(prompt)))
  trace = np.where(np.arange(max_new_tokens) < len(seq) - len(prompt), np.arange(max_new_tokens), -1)
  return _finish(response, trace, stop_ids, cfg.pad_token_id, len(seq) - len(prompt))


def llada2_block(model, prompt, *, block_size, max_new_tokens, steps, threshold, stop_ids) -> dict:
  """LLaDA2's released generate, one row, greedy: blocks aligned to position 0 (the prompt unpadded), the
  window up to the current block recomputed each step under the block-diffusion mask, every masked position
  of the block above `threshold` accepted, else the schedule's count most confident; stop after a block once
  the response holds a stop id."""
  cfg = model.config
  p = len(prompt)
  total = -(-(p + max_new_tokens) // block_size) * block_size
  seq = np.array(list(prompt) + [cfg.mask_token_id] * (total - p), np.int64)
  trace = np.full(total - p, -1)
  counts = [block_size // steps + (s < block_size % steps) for s in range(steps)]
  forwards = 0
  for b in range(p // block_size, total // block_size):
    lo, hi = b * block_size, (b + 1) * block_size
    for step in range(steps):
      masked = [i for i in range(max(lo, p), hi) if seq[i] == cfg.mask_token_id]
      if not masked:
        break
      probs = _softmax(_logits(model, seq[:hi], "block_causal", prompt_len=0, block_size=block_size))
      forwards += 1
      choice = {i: int(np.argmax(probs[i])) for i in masked}
      conf = {i: float(probs[i][choice[i]]) for i in masked}
      high = [i for i in masked if conf[i] > np.float32(threshold)]
      k = min(counts[step], len(masked))
      chosen = high if len(high) >= k else sorted(masked, key=lambda i: (-conf[i], i))[:k]
      for i in chosen:
        seq[i] = choice[i]
        trace[i - p] = forwards - 1
    if any(t in stop_ids for t in seq[p:hi]):
      break
  return _finish(seq[p:p + max_new_tokens], trace[:max_new_tokens], stop_ids, cfg.pad_token_id, forwards)


def llada21_editing(model, prompt, *, block_size, max_new_tokens, threshold, editing_threshold, max_post_steps,
                    stop_ids) -> dict:
  """LLaDA2.1's released generate (token editing), one row, greedy, as its loop reads: per block, before
  each forward count the forwards begun with no mask left and end the block once they exceed
  `max_post_steps`; a forward accepts the masks above `threshold` (else the most confident one) and rewrites
  every decided response token of the block whose argmax differs with probability above `editing_threshold`;
  a forward that began with no mask and rewrote nothing ends the block. Stop after a block once the response
  holds a stop id. The mask token is never chosen."""
  cfg = model.config
  p = len(prompt)
  total = -(-(p + max_new_tokens) // block_size) * block_size
  seq = np.array(list(prompt) + [cfg.mask_token_id] * (total - p), np.int64)
  trace = np.full(total - p, -1)
  forwards = rewrites = 0
  for b in range(p // block_size, total // block_size):
    lo, hi = b * block_size, (b + 1) * block_size
    block = range(max(lo, p), hi)
    post = 0
    while True:
      if all(seq[i] != cfg.mask_token_id for i in block):
        post += 1
      if post > max_post_steps:
        break
      logits = np.array(_logits(model, seq[:hi], "block_causal", prompt_len=0, block_size=block_size))
      logits[:, cfg.mask_token_id] = -np.inf  # the mask is never chosen (decode/block_sampler.py says why)
      probs = _softmax(logits)
      forwards += 1
      choice = {i: int(np.argmax(probs[i])) for i in block}
      conf = {i: float(probs[i][choice[i]]) for i in block}
      masked = [i for i in block if seq[i] == cfg.mask_token_id]
      high = [i for i in masked if conf[i] > np.float32(threshold)]
      chosen = high if high or not masked else sorted(masked, key=lambda i: (-conf[i], i))[:1]
      edits = [i for i in block if i not in masked and choice[i] != seq[i] and conf[i] > np.float32(editing_threshold)]
      for i in chosen + edits:
        seq[i] = choice[i]
        trace[i - p] = forwards - 1
      rewrites += len(edits)
      if not masked and not edits:
        break
    if any(t in stop_ids for t in seq[p:hi]):
      break
  return _finish(seq[p:p + max_new_tokens], trace[:max_new_tokens], stop_ids, cfg.pad_token_id, forwards,
                 rewrites=rewrites)
