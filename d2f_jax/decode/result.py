"""What every decoder returns, and the one rule for where a generation ends."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from d2f_jax.decode.sampling import is_stop


@flax.struct.dataclass
class DecodeResult:
  """Per-row outcome of a batched decode.

  tokens: [B, N] generated ids up to and including the first stop token (in position order), the model's
    pad id after it. Positions after the first stop may still have been decoded (blocks already in flight
    finish, as in the reference); they are dropped here but their acceptance steps stay in `trace`.
  lengths: [B] tokens before the padding. forwards / steps: [B] model calls and loop steps the row took.
  trace: [B, N] step (0 = the first forward) at which each position was accepted, -1 if never decoded.
  max_in_flight / semi_steps / max_accepted: [B] d2f diagnostics: most blocks decoding in one forward,
    forwards that saw a semi-activated block, most tokens accepted in one step (zero for other methods).
  in_flight_sum / window_sum: [B] d2f: blocks in flight and window width (blocks) summed over the row's
    forwards (divide by `forwards` for the means; zero for other methods).
  position_sum: [B] d2f: positions its step forwards computed (the compiled width, the prefill's prompt not
    counted), summed; zero for other methods.
  """

  tokens: jax.Array
  lengths: jax.Array
  forwards: jax.Array
  steps: jax.Array
  trace: jax.Array
  max_in_flight: jax.Array
  semi_steps: jax.Array
  max_accepted: jax.Array
  in_flight_sum: jax.Array
  window_sum: jax.Array
  position_sum: jax.Array

  def to_lists(self) -> list[list[int]]:
    """Generated ids per row, without the padding."""
    tokens, lengths = np.asarray(self.tokens), np.asarray(self.lengths)
    return [tokens[b, :lengths[b]].tolist() for b in range(tokens.shape[0])]


def cut_at_stop(response: jax.Array, stop_ids: jax.Array, pad_id: int) -> tuple[jax.Array, jax.Array]:
  """response [B, N] -> (tokens padded after the first stop token, lengths [B])."""
  stops = is_stop(response, stop_ids)  # [B, N]
  width = response.shape[1]
  lengths = jnp.where(stops.any(axis=1), jnp.argmax(stops, axis=1) + 1, width).astype(jnp.int32)
  keep = jnp.arange(width)[None, :] < lengths[:, None]
  return jnp.where(keep, response, pad_id).astype(jnp.int32), lengths


def make_result(response, trace, stop_ids, pad_id, forwards, steps=None, max_in_flight=None, semi_steps=None,
                max_accepted=None, in_flight_sum=None, window_sum=None, position_sum=None) -> DecodeResult:
  tokens, lengths = cut_at_stop(response, stop_ids, pad_id)
  zeros = jnp.zeros_like(lengths)
  return DecodeResult(tokens=tokens, lengths=lengths, forwards=forwards.astype(jnp.int32),
                      steps=(forwards if steps is None else steps).astype(jnp.int32), trace=trace.astype(jnp.int32),
                      max_in_flight=zeros if max_in_flight is None else max_in_flight,
                      semi_steps=zeros if semi_steps is None else semi_steps,
                      max_accepted=zeros if max_accepted is None else max_accepted,
                      in_flight_sum=zeros if in_flight_sum is None else in_flight_sum,
                      window_sum=zeros if window_sum is None else window_sum,
                      position_sum=zeros if position_sum is None else position_sum)


def decoded_prefix(response, mask_token_id: int) -> list[int]:
  """The ids of a host response row [N] before its first mask token (what `stream` can show)."""
  response = np.asarray(response)
  masked = response == mask_token_id
  return response[:int(np.argmax(masked)) if masked.any() else response.size].tolist()
