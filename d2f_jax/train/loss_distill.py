"""Asymmetric distillation loss: block-causal student against a bidirectional teacher on one noised batch.

loss = sum_{masked} (1 / p_i) * CE(softmax(teacher), student) / #masked, with Dream's logit shift on both.
CE against the teacher's softmax equals forward KL(teacher || student) plus the teacher's entropy, so the
KL is reported beside it: it is what training can drive to zero.
Logits are formed chunk by chunk of sequence rows under `jax.checkpoint` (train/chunks.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from d2f_jax.models import Transformer, align_logits, attention_ids
from d2f_jax.train.chunks import map_row_chunks
from d2f_jax.train.masking import Noised
from d2f_jax.train.router_stats import trained_hidden


def soft_cross_entropy(teacher_logits: jax.Array, student_logits: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(CE(softmax(t), s), entropy(softmax(t))) over the last axis, both fp32 [...]."""
  t_logp = jax.nn.log_softmax(teacher_logits.astype(jnp.float32), axis=-1)
  s_logp = jax.nn.log_softmax(student_logits.astype(jnp.float32), axis=-1)
  t_p = jnp.exp(t_logp)
  return -jnp.sum(t_p * s_logp, axis=-1), -jnp.sum(t_p * t_logp, axis=-1)


def _token_losses(teacher: Transformer, student: Transformer, t_hidden, s_hidden, chunk: int):
  """Per-token (CE, teacher entropy) [B, T] from final hidden states [B, T, E], `chunk` rows at a time."""
  def one(hiddens):
    th, sh = hiddens  # [B, C, E]
    return soft_cross_entropy(teacher.logits_from_hidden(th), student.logits_from_hidden(sh))
  return map_row_chunks(one, (t_hidden, s_hidden), chunk)


def distill_sums(teacher: Transformer, student: Transformer, noised: Noised, prompt_len: jax.Array, *,
                 block_size: int, dropout_key: jax.Array | None = None, chunk: int = 0) -> dict[str, jax.Array]:
  """Sums over the batch (so microbatches and shards add up exactly): weighted CE, weighted KL, #masked.

  The teacher sees the noised rows bidirectionally, the student block-causally (blocks of `block_size`
  from each row's `prompt_len` [B]); padding EOS is ordinary response, so no validity mask.
  """
  batch, length = noised.tokens.shape
  config = student.config
  positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))  # [B, T]
  t_ids = attention_ids(positions, "bidirectional")
  s_ids = attention_ids(positions, "block_causal", prompt_len=prompt_len, block_size=block_size,
                        prompt_blocks=config.prompt_blocks)
  t_hidden, _ = teacher.hidden_states(noised.tokens, positions, t_ids)  # [B, T, E]
  t_hidden = jax.lax.stop_gradient(t_hidden)
  s_hidden, router = trained_hidden(student, noised.tokens, positions, s_ids, dropout_key=dropout_key)
  # Dream's shift moves whole output rows; logits are row-wise linear in hidden states, so shift those.
  t_hidden, s_hidden = align_logits(t_hidden, config), align_logits(s_hidden, config)
  ce, ent = _token_losses(teacher, student, t_hidden, s_hidden, chunk)  # [B, T]
  w = jax.lax.stop_gradient(noised.weight)  # 1 / p_i on masked positions, 0 elsewhere
  return {"ce": jnp.sum(w * ce), "kl": jnp.sum(w * (ce - ent)),
          "masked": jnp.sum(noised.masked.astype(jnp.float32)),
          "response": jnp.sum(noised.response.astype(jnp.float32)), **router}
