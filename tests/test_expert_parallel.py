"""Expert parallelism (models/expert_parallel.py) on 8 fake CPU devices: a MoE layer's output, router load
and input gradient under each way the experts can be split equal the one-device computation, and each way
runs the collective it is meant to (psum for tokens replicated along the expert axis, all_to_all for tokens
split along it), so a silent fallback to the one-device path cannot pass."""

import json
import os
import subprocess
import sys

_CHILD = r"""
import json
import jax, jax.numpy as jnp, numpy as np
from d2f_jax.models.config import TINY_LLADA2
from d2f_jax.models.moe import moe_mlp
from d2f_jax.sharding import DEFAULT_RULES, make_mesh, mesh_layout, layout_from_rules, normalize_rules

moe = TINY_LLADA2.moe  # 8 experts, 3 per token, 2 groups
E, F, X = 64, moe.expert_mlp_dim, moe.num_experts
rng = np.random.default_rng(0)
def rand(*shape, scale=0.2):
  return jnp.asarray(rng.normal(size=shape) * scale, jnp.float32)
w = {"router": rand(E, X, scale=0.5), "expert_bias": rand(X, scale=0.1), "expert_gate": rand(X, E, F),
     "expert_up": rand(X, E, F), "expert_down": rand(X, F, E), "shared_gate": rand(E, F), "shared_up": rand(E, F),
     "shared_down": rand(F, E)}
h = rand(8, 5, E, scale=1.0)  # [B, T, E]

def run(h, w):
  out, load = moe_mlp(h, w, moe)
  grad = jax.grad(lambda h: (moe_mlp(h, w, moe)[0] ** 2).sum())(h)
  return out, load, grad

want = jax.jit(run)(h, w)
cases = {"experts on tensor, rows on data": ({"data": 2, "tensor": 4}, DEFAULT_RULES),
         "experts on data, rows on data": ({"data": 4, "tensor": 2}, {**dict(DEFAULT_RULES), "expert": "data"}),
         "experts on all 8, rows on all 8": ({"data": 8}, {**dict(DEFAULT_RULES), "expert": "data"})}
report = {}
for name, (sizes, rules) in cases.items():
  rules = normalize_rules(tuple(dict(rules).items()))  # "expert" -> data replaces the default's tensor
  mesh = make_mesh(sizes)
  layout = layout_from_rules(mesh, rules)
  def sharded(h, w):
    with mesh_layout(layout):
      return run(h, w)
  fn = jax.jit(sharded)
  text = fn.lower(h, w).as_text()
  got = jax.block_until_ready(fn(h, w))
  report[name] = {"expert_axis": layout.expert_axis,
                  "diff": [float(jnp.abs(a - b).max() / jnp.abs(b).max()) for a, b in zip(got, want)],
                  "all_to_all": "all_to_all" in text or "all-to-all" in text,
                  "psum": "all_reduce" in text or "psum" in text, "manual": "sdy.manual_computation" in text}
# dispatch="auto" over an expert axis keeps the platform's rule: on the CPU dense past 1 token a device (20
# here), the experts sharded but no shard_map (XLA:GPU / CPU expand ragged to k times dense's buffers)
import dataclasses
auto = dataclasses.replace(moe, dispatch="auto")
mesh = make_mesh({"data": 2, "tensor": 4})
layout = layout_from_rules(mesh, normalize_rules(tuple(dict(DEFAULT_RULES).items())))
def auto_run(h, w):
  with mesh_layout(layout):
    return moe_mlp(h, w, auto)[0]
fn = jax.jit(auto_run)
got = jax.block_until_ready(fn(h, w))
report["auto"] = {"expert_axis": layout.expert_axis,
                  "diff": [float(jnp.abs(got - want[0]).max() / jnp.abs(want[0]).max())],
                  "manual": "sdy.manual_computation" in fn.lower(h, w).as_text()}
print("RESULT" + json.dumps(report))
"""


def test_each_expert_split_equals_one_device():
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
         "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
  proc = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=300,
                        cwd=root)
  assert proc.returncode == 0, proc.stderr[-4000:]
  report = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))[len("RESULT"):])
  auto = report.pop("auto")
  assert auto["expert_axis"] == "tensor" and not auto["manual"] and auto["diff"][0] < 1e-5, auto
  for name, r in report.items():
    assert r["manual"], (name, r)  # the experts ran in shard_map, not through the one-device path
    assert max(r["diff"]) < 1e-6, (name, r)  # output, load, input gradient (relative): summation order only
  replicated, by_data, all8 = report.values()
  assert replicated["expert_axis"] == "tensor" and replicated["psum"] and not replicated["all_to_all"], replicated
  assert by_data["expert_axis"] == "data" and by_data["all_to_all"], by_data
  assert all8["expert_axis"] == "data" and all8["all_to_all"], all8
