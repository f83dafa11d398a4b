"""One decode forward as a stand-alone jitted program: the D2F step at one fixed window width, the AR step, the
two prefills (D2F's init: prompt + first block; AR's init: the prompt) and vanilla's no-cache forward.

Why: `generate` runs init + `lax.while_loop` + finish in one program, and a compiler's cost analysis counts a
loop body once, whatever its trip count; the D2F step also switches between widths (`lax.switch`). A cost
per forward needs each piece alone. These are the loop's own init / step functions (pipeline.py,
baselines.py), traced in the same mesh layout with the loop state pinned to it, so the bench that compiles
them (`bench cost`, abstract weights: nothing allocated) and the ones that time them (`bench device`, the
main job's CPU ceiling) measure what the loop runs per step.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from d2f_jax.decode import baselines, pipeline
from d2f_jax.decode.config import DecodeConfig, DecodeSpec, resolve
from d2f_jax.decode.mesh import as_decode_mesh, constrain_loop_state
from d2f_jax.models import ModelConfig, abstract_model, with_shardings
from d2f_jax.sharding import mesh_layout

KINDS = ("d2f_step", "ar_step", "full_step", "d2f_prefill", "ar_prefill")
_METHOD = {"d2f_step": "d2f", "d2f_prefill": "d2f", "ar_step": "ar", "ar_prefill": "ar", "full_step": "vanilla"}
_INIT = {"d2f": pipeline.init, "ar": baselines.init_ar, "vanilla": baselines.init_full}
_STEP = {"d2f": pipeline.step, "ar": baselines.step_ar, "vanilla": baselines.step_full}


@dataclasses.dataclass(frozen=True)
class StepShape:
  """What one forward computes: `kind` at `batch` rows, a prompt of `prompt` tokens (the padded width),
  `new_tokens` response tokens in blocks of `block_size`, and (d2f) a window of `width` blocks.
  The KV cache holds prompt + new_tokens slots."""

  kind: str
  batch: int
  prompt: int
  new_tokens: int
  block_size: int
  width: int = 1

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"StepShape.kind must be one of {KINDS}, got {self.kind!r}")
    for name in ("batch", "prompt", "new_tokens", "block_size", "width"):
      value = getattr(self, name)
      if not isinstance(value, int) or value <= 0:
        raise ValueError(f"StepShape.{name} must be a positive int, got {value!r}")
    if self.new_tokens % self.block_size or self.width > self.new_tokens // self.block_size:
      raise ValueError(f"StepShape: new_tokens ({self.new_tokens}) must be a multiple of block_size "
                       f"({self.block_size}) with at least width ({self.width}) blocks")

  @property
  def tokens(self) -> int:
    """Tokens the forward computes (its queries)."""
    return {"d2f_step": self.width * self.block_size, "ar_step": 1, "full_step": self.prompt + self.new_tokens,
            "d2f_prefill": self.prompt + self.block_size, "ar_prefill": self.prompt}[self.kind]


def spec_for(config: ModelConfig, shape: StepShape):
  """(DecodeSpec, Knobs) of `shape`: for d2f one compiled width, `shape.width` blocks (no switch)."""
  method = _METHOD[shape.kind]
  decode = DecodeConfig(method=method, block_size=shape.block_size, max_new_tokens=shape.new_tokens,
                        stop_ids=(), prompt_buckets=shape.prompt)
  spec, knobs = resolve(decode, config)
  if method == "d2f":  # window_blocks = min(cap + 1, blocks) = width, and the width set is that width alone
    spec = dataclasses.replace(spec, max_blocks_in_flight=shape.width - 1, window_widths=(shape.width,))
  return spec, knobs


def _init_fn(graphdef, spec: DecodeSpec, layout) -> Callable:
  def init(params, prompt, prompt_len, key, knobs):
    with mesh_layout(layout):
      state = _INIT[spec.method](nnx.merge(graphdef, params), prompt, prompt_len, key, knobs, spec)
      return constrain_loop_state(state, layout, prompt.shape[0])
  return jax.jit(init)


def _step_fn(graphdef, spec: DecodeSpec, layout) -> Callable:
  def step(params, state, knobs):
    with mesh_layout(layout):
      rows = state.prompt_len.shape[0]
      state = constrain_loop_state(state, layout, rows)
      state = _STEP[spec.method](nnx.merge(graphdef, params), state, knobs, spec)
      return constrain_loop_state(state, layout, rows)
  return jax.jit(step, donate_argnums=1)  # the cache is updated in place, as in the loop's carry


@dataclasses.dataclass(frozen=True)
class ForwardProbe:
  """fn(*args) runs one forward of `shape`: a prefill returns the loop state, a step the next state.
  args are abstract (ShapeDtypeStructs with shardings) for a ModelConfig, concrete for a model."""

  shape: StepShape
  fn: Callable
  args: tuple
  spec: DecodeSpec
  init: Callable  # the prefill of the same spec (a step's state comes from it)

  def lower(self):
    return self.fn.lower(*self.args)


def forward_probe(model, shape: StepShape, *, mesh=None, rules=None, prompt=None, key=None) -> ForwardProbe:
  """The program of one forward of `shape`.

  model: a ModelConfig (abstract weights from it; with `mesh`, sharded by the rules, nothing allocated) or a
  model handle with .config / .graphdef / .state (concrete: a step's state is made by running the prefill on
  `prompt` [batch, shape.prompt] int32, default token 0 everywhere). mesh: a jax Mesh (data / fsdp / tensor)
  over real or compile-only devices, or None for the default device.
  """
  placement = as_decode_mesh(mesh, rules)
  layout = None if placement is None else placement.layout
  if isinstance(model, ModelConfig):
    graphdef, state = nnx.split(abstract_model(model))
    config, abstract = model, True
  else:
    graphdef, state, config, abstract = model.graphdef, model.state, model.config, False
  spec, knobs = spec_for(config, shape)
  rows = shape.batch if placement is None else placement.padded_batch(shape.batch)

  def place(x, sharding):
    if abstract:
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    return x if sharding is None else jax.device_put(x, sharding)
  rep = None if placement is None else placement.replicated()
  if abstract:
    shardings = (jax.tree.map(lambda _: None, nnx.to_pure_dict(state)) if placement is None
                 else placement.param_shardings(state))
    params = with_shardings(state, shardings)
    tokens = jax.ShapeDtypeStruct((rows, shape.prompt), jnp.int32)
    key = jax.eval_shape(lambda: jax.random.key(0))
  else:
    params = state
    tokens = jnp.zeros((rows, shape.prompt), jnp.int32) if prompt is None else jnp.asarray(prompt, jnp.int32)
    key = jax.random.key(0) if key is None else key
  row_sharding = (lambda n: None) if placement is None else placement.rows
  prompt_args = (place(tokens, row_sharding(2)),
                 place(jnp.full((rows,), shape.prompt, jnp.int32) if not abstract
                       else jax.ShapeDtypeStruct((rows,), jnp.int32), row_sharding(1)),
                 place(key, rep), jax.tree.map(lambda x: place(x, rep), knobs))
  init = _init_fn(graphdef, spec, layout)
  if shape.kind.endswith("_prefill"):
    return ForwardProbe(shape, init, (params, *prompt_args), spec, init)
  state_in: Any = (jax.eval_shape(init, params, *prompt_args) if abstract else init(params, *prompt_args))
  return ForwardProbe(shape, _step_fn(graphdef, spec, layout), (params, state_in, prompt_args[3]), spec, init)


def time_ms(program: ForwardProbe, repeats: int) -> float:
  """ms per call of a concrete program, after one call that compiles it (not timed). A step's state is
  carried from call to call (donated: the cache is updated in place, as in the loop); a prefill is rerun."""
  if program.shape.kind.endswith("_prefill"):
    def call(_):
      return program.fn(*program.args)
  else:
    params, _, knobs = program.args

    def call(state):
      return program.fn(params, state, knobs)
  state = jax.block_until_ready(call(program.args[1]))
  start = time.perf_counter()
  for _ in range(repeats):
    state = call(state)
  jax.block_until_ready(state)
  return 1000 * (time.perf_counter() - start) / repeats
