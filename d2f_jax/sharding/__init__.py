"""The one home of sharding, on the ground floor: mesh axes and logical-axis rules, building the mesh, placing
values on it, and the activation layout the model is traced in. Training, decoding, the API and the
ahead-of-time checks all import it from here, so a checkpoint decodes on the mesh it was trained on.

    from d2f_jax import sharding
    mesh = sharding.make_mesh(sharding.parse_mesh("data=2,tensor=4"))
    spec = sharding.logical_spec(("embed", "heads"), sharding.DEFAULT_RULES, mesh, (4096, 32))
"""

from d2f_jax.sharding.layout import MeshLayout, constrain_batch, current_layout, layout_from_rules, mesh_layout
from d2f_jax.sharding.mesh import make_mesh, maybe_initialize_distributed, multiprocess_launch, parse_mesh
from d2f_jax.sharding.placement import abstract_with, host_to_global, to_global
from d2f_jax.sharding.rules import (DEFAULT_RULES, MESH_AXES, Rules, batch_sharding, logical_spec, normalize_rules,
                                    packed_axis, replicated, rule_axes, state_shardings)

__all__ = [
    "DEFAULT_RULES", "MESH_AXES", "MeshLayout", "Rules", "abstract_with", "batch_sharding", "constrain_batch",
    "current_layout", "host_to_global", "layout_from_rules", "logical_spec", "make_mesh",
    "maybe_initialize_distributed", "mesh_layout", "multiprocess_launch", "normalize_rules", "packed_axis",
    "parse_mesh", "replicated", "rule_axes", "state_shardings", "to_global",
]
