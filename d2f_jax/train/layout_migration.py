"""Training checkpoints written before attention heads were packed with head_dim (converted-directory format
version 1's layout: q / k / v [L, E, heads, D], o [L, H, D, E]; LoRA q / k / v b [L, r, heads, D], o's a
[L, H, D, r]; Adam moments alike). The bytes are today's in C order, so such a checkpoint resumes: its leaves
are restored as saved, replicated, then reshaped and laid out as the config's."""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from d2f_jax.convert.checkpoint import packed_shape
from d2f_jax.train.digest import leaf_path


def shapes_of(tree) -> dict[str, tuple[int, ...]]:
  """{'params/layers/q_lora_a': shape, ...} of a state tree or its orbax metadata (same paths either way)."""
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {leaf_path(path): tuple(leaf.shape) for path, leaf in leaves}


def packing_only(saved: dict, wanted: dict) -> bool:
  """Whether saved shapes ({path: shape}) differ from the wanted ones only by the old attention layout."""
  if set(saved) != set(wanted):
    return False
  differ = [k for k in wanted if saved[k] != wanted[k]]
  return bool(differ) and all(packed_shape(k, saved[k]) == wanted[k] for k in differ)


def unpacked_target(saved: dict, wanted_tree: dict) -> tuple[dict, set[str]]:
  """(the tree to restore into, the paths held in the old layout) for saved shapes ({path: shape}): those
  leaves are restored as saved, replicated over the wanted leaf's mesh; the others as wanted."""
  wanted = shapes_of(wanted_tree)
  if not saved or not packing_only(saved, wanted):
    return wanted_tree, set()
  unpacked = {k for k, shape in wanted.items() if saved[k] != shape}

  def leaf(path, x):
    name = leaf_path(path)
    if name not in unpacked:
      return x
    return jax.ShapeDtypeStruct(saved[name], x.dtype, sharding=NamedSharding(x.sharding.mesh, P()))
  return jax.tree_util.tree_map_with_path(leaf, wanted_tree), unpacked


def pack(state: dict, wanted: dict, unpacked: set[str]) -> dict:
  """`state` with its old-layout leaves reshaped and laid out as `wanted`'s."""
  def leaf(path, x, want):
    if leaf_path(path) not in unpacked:
      return x
    return jax.device_put(x.reshape(want.shape), want.sharding)
  return jax.tree_util.tree_map_with_path(leaf, state, wanted)
