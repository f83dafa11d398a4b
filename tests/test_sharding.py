"""Logical-axis rules, and a data x fsdp x tensor = 2x2x2 run on 8 fake CPU devices that equals one device.

The 8-device run is a subprocess: XLA_FLAGS must be set before JAX starts, and this process's JAX is already
up with one device. The child blocks on every step's results (queued CPU collectives can deadlock).
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
from jax.sharding import AbstractMesh, PartitionSpec as P

from d2f_jax import sharding
from d2f_jax.sharding import DEFAULT_RULES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESH = AbstractMesh((2, 2, 2), ("data", "fsdp", "tensor"))


def test_logical_rules_map_parameter_axes():
  spec = sharding.logical_spec(("layers", "embed", "heads", "head_dim"), DEFAULT_RULES, MESH, (2, 64, 8, 16))
  assert spec == P(None, "fsdp", "tensor", None)
  assert sharding.logical_spec(("batch", None), DEFAULT_RULES, MESH) == P(("data", "fsdp"), None)
  assert sharding.logical_spec(("vocab", "embed"), DEFAULT_RULES, MESH, (512, 64)) == P("tensor", "fsdp")


def test_rules_skip_axes_that_do_not_divide_or_repeat():
  # One KV head cannot be split two ways: it stays replicated instead of failing.
  assert sharding.logical_spec(("embed", "kv_heads"), DEFAULT_RULES, MESH, (64, 1)) == P("fsdp", None)
  rules = (("embed", "fsdp"), ("mlp", "fsdp"))
  assert sharding.logical_spec(("embed", "mlp"), rules, MESH, (64, 160)) == P("fsdp", None)
  with pytest.raises(ValueError, match="'lora_rank' has no rule"):
    sharding.logical_spec(("lora_rank",), (("embed", "fsdp"),), MESH)
  with pytest.raises(ValueError, match="mesh axis 'model'"):
    sharding.logical_spec(("embed",), (("embed", "model"),), MESH)



def test_packed_heads_shard_in_whole_heads_only():
  """q stored [E, H*D] ('heads:D'): split by the heads rule only where every shard holds whole heads. Dream-7B's
  28 heads of 128 on tensor 8: 3584 divides by 8, 28 does not, so q stays replicated over tensor (as [E, H, D]
  did); on tensor 4 (7 heads a shard) it splits."""
  packed = sharding.packed_axis("heads", 128)
  assert packed == "heads:128"
  tensor8 = AbstractMesh((1, 1, 8), ("data", "fsdp", "tensor"))
  tensor4 = AbstractMesh((1, 1, 4), ("data", "fsdp", "tensor"))
  assert sharding.logical_spec(("embed", packed), DEFAULT_RULES, tensor8, (3584, 28 * 128)) == P(None, None)
  assert sharding.logical_spec(("embed", packed), DEFAULT_RULES, tensor4, (3584, 28 * 128)) == P(None, "tensor")
  assert sharding.logical_spec((packed, "embed"), DEFAULT_RULES, MESH, (32 * 128, 4096)) == P("tensor", "fsdp")
  with pytest.raises(ValueError, match=r"'heads:128' packs units of 128, but the dimension has size 100"):
    sharding.logical_spec(("embed", packed), DEFAULT_RULES, MESH, (64, 100))

def test_mesh_sizes_are_checked():
  with pytest.raises(ValueError, match="needs 8 devices"):
    sharding.make_mesh(dict(data=2, fsdp=2, tensor=2))
  assert sharding.make_mesh(dict(data=1, fsdp=-1, tensor=1)).shape["fsdp"] == 1


@pytest.mark.parametrize("env,multi", [({}, False), ({"SLURM_NTASKS": "1"}, False), ({"SLURM_NTASKS": "4"}, True),
                                       ({"OMPI_COMM_WORLD_SIZE": "2"}, True), ({"TPU_WORKER_HOSTNAMES": "a,b"}, True),
                                       ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"}, True)])
def test_multi_host_launches_are_detected(monkeypatch, env, multi):
  for var in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES", *sharding.mesh.MULTIPROCESS_ENV):
    monkeypatch.delenv(var, raising=False)
  for var, value in env.items():
    monkeypatch.setenv(var, value)
  assert sharding.multiprocess_launch() is multi
  assert sharding.maybe_initialize_distributed("off") is False


_CHILD = textwrap.dedent("""
    import functools, json, os, sys
    import jax, jax.numpy as jnp, numpy as np
    jax.config.update("jax_default_matmul_precision", "highest")
    jax.config.update("jax_disable_most_optimizations", True)
    from flax import nnx
    from d2f_jax.models import TINY_DREAM, TINY_LLADA, LoraConfig
    from d2f_jax.models.config import TINY_LLADA2
    from d2f_jax import sharding
    from d2f_jax.sharding import DEFAULT_RULES as RULES
    from d2f_jax.train.model import BASE, TrainModels
    from d2f_jax.train.optim import OptimSpec
    from d2f_jax.train.schedule import Schedule
    from d2f_jax.train.state import create_state
    from d2f_jax.train.step import StepSpec, compiled_train_step, loss_and_grads
    from model_utils import random_model, random_tokens

    assert jax.device_count() == 8, jax.devices()

    def run(config, lora, mesh, micro):
      models = TrainModels.create(config, lora)
      model = random_model(config, lora, seed=0)
      frozen = jax.device_put(nnx.to_pure_dict(nnx.state(model, BASE)),
                              sharding.state_shardings(models.abstract_frozen(), mesh, RULES))
      trainable = nnx.to_pure_dict(nnx.state(model, nnx.LoRAParam)) if lora else frozen
      trainable = jax.device_put(trainable, sharding.state_shardings(models.abstract_trainable(), mesh, RULES))
      bsh = sharding.batch_sharding(mesh, RULES)
      batch = {"tokens": jax.device_put(random_tokens(config, 8, 24, seed=1), bsh),
               "prompt_len": jax.device_put(jnp.array([3, 0, 5, 7, 2, 9, 4, 1], jnp.int32),
                                            sharding.batch_sharding(mesh, RULES, 1))}
      spec = StepSpec(models, Schedule(), OptimSpec(lr=1e-3), block_size=4, micro_batches=micro, batch_sharding=bsh)
      grads, sums = jax.jit(functools.partial(loss_and_grads, spec))(trainable, frozen, batch, jax.random.PRNGKey(3))
      jax.block_until_ready((grads, sums))
      state = create_state(models, spec.optim, frozen, 0, mesh, RULES)
      step = compiled_train_step(spec, mesh, RULES)
      losses = []
      for _ in range(2):
        state, metrics = step(state, frozen, batch)
        jax.block_until_ready((state, metrics))
        losses.append(float(metrics["loss"]))
      layouts = {"frozen_q": str(frozen["layers"]["q"].sharding.spec),
                 "trainable_first": str(jax.tree.leaves(state.params)[0].sharding.spec),
                 "adam_mu_first": str(jax.tree.leaves(state.opt_state[1][0].mu)[0].sharding.spec)}
      loss = float(sums["ce"] / sums["masked"])
      return loss, jax.device_get(grads), losses, jax.device_get(state.params), layouts

    def rel(a, b):
      return max(float(np.abs(x - y).max() / max(np.abs(x).max(), 1e-30))
                 for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))

    def outliers(a, b):  # the fraction of entries off by more than 1e-4 of their leaf's scale, and the largest
      pairs = [(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))]
      far = sum(int((np.abs(x - y) > 1e-4 * max(np.abs(x).max(), 1e-30)).sum()) for x, y in pairs)
      return far / sum(x.size for x, _ in pairs), max(float(np.abs(x - y).max()) for x, y in pairs)

    one = sharding.make_mesh(dict(data=1, fsdp=1, tensor=1), jax.devices()[:1])
    eight = sharding.make_mesh(dict(data=2, fsdp=2, tensor=2))
    out = {}
    for name, config, lora, micro in (("lora", TINY_LLADA, LoraConfig(rank=4, alpha=8.0, dropout=0.1), 2),
                                      ("full", TINY_DREAM, None, 1),
                                      ("moe", TINY_LLADA2, LoraConfig(rank=4, alpha=8.0), 1)):
      l1, g1, s1, p1, _ = run(config, lora, one, micro)
      l8, g8, s8, p8, layouts = run(config, lora, eight, micro)
      out[name] = {"loss": [l1, l8], "grad_rel": rel(g1, g8), "steps": [s1, s8], "param_outliers": outliers(p1, p8),
                   "layouts": layouts}
    print("RESULT" + json.dumps(out))
""")


def test_2x2x2_mesh_matches_one_device():
  """LoRA on LLaDA, full finetuning of Dream and LoRA on LLaDA2 (its 8 experts split 4 a shard over tensor,
  models/expert_parallel.py) train on data x fsdp x tensor as on one device."""
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
         "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH", "")])}
  proc = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=600,
                        cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-4000:]
  line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
  out = json.loads(line[len("RESULT"):])
  for name, r in out.items():
    one, eight = r["loss"]
    assert abs(one - eight) <= 1e-5 * abs(one), (name, r["loss"])
    assert r["grad_rel"] < 1e-5, (name, r["grad_rel"])
    for a, b in zip(*r["steps"]):
      assert abs(a - b) <= 1e-5 * abs(a), (name, r["steps"])
    # Adam divides each gradient entry by its own scale, so float rounding in a near-zero entry can move that
    # parameter by up to lr a step either way (the summation order, and so the rounding, differs by CPU
    # model). Sharding mistakes move many entries: at most 1 in 1000 may be off by 1e-4 of their tensor's
    # scale, and none by more than Adam's bound, 2 steps x lr (1e-3) x 2 (the two signs).
    fraction, largest = r["param_outliers"]
    assert fraction < 1e-3 and largest <= 4e-3, (name, r["param_outliers"])
  # Weights really are split: embed over fsdp, heads over tensor; Adam moments follow their parameters.
  assert out["full"]["layouts"]["frozen_q"] == str(P(None, "fsdp", "tensor"))  # [L, E, H*D]: whole heads
  assert out["full"]["layouts"]["trainable_first"] == out["full"]["layouts"]["adam_mu_first"] != str(P())
