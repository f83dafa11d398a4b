"""Digests of a checkpoint's contents, written with it and checked on restore.

Why: orbax keeps no checksum of array bytes, so a checkpoint damaged on disk (a flipped block of an array
file) restored without a word and training diverged steps later, blaming the learning rate. Each saved
array's sha256 (over dtype, shape and bytes, in the process's host copy) and the data position's (over its
canonical JSON) are saved as a third checkpoint item, `digest`; a restore that does not reproduce them is
refused like any other damage. Arrays that span several processes are not digested (their bytes are on no
one host); single-process runs, which is every run that resumes on one machine, digest everything.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

ALGORITHM = "sha256"
FORMAT_VERSION = 1


class DigestMismatch(ValueError):
  """A restored checkpoint item whose bytes differ from the digest saved with it."""


def leaf_path(path) -> str:
  """'params/layers/q_lora_a' of a jax tree path (dict keys, sequence indices or attribute names): how
  digests, and the checkpoint's shape checks, name a state's leaves."""
  names = []
  for key in path:
    attr = next((a for a in ("key", "idx", "name") if hasattr(key, a)), None)
    names.append(str(getattr(key, attr)) if attr else str(key))
  return "/".join(names)


def _host_bytes(leaf) -> np.ndarray | None:
  """A host numpy view of one leaf (typed PRNG keys as their raw data), None when it spans processes."""
  if isinstance(leaf, jax.Array):
    if not leaf.is_fully_addressable:
      return None
    if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      leaf = jax.random.key_data(leaf)
  return np.ascontiguousarray(jax.device_get(leaf))


def array_digest(value: np.ndarray) -> str:
  h = hashlib.sha256(f"{value.dtype.str}{value.shape}".encode())
  h.update(memoryview(value).cast("B") if value.size else b"")
  return h.hexdigest()


def tree_digests(tree) -> dict[str, str | None]:
  """{'params/layers/q_lora_a': sha256 hex, ...}: every leaf of a state tree (None: spans processes). Leaves
  are hashed in threads (hashlib lets go of the GIL), so a save pays about the largest array's hash."""
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  values = [_host_bytes(leaf) for _, leaf in leaves]
  with concurrent.futures.ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1))) as pool:
    digests = list(pool.map(lambda v: None if v is None else array_digest(v), values))
  return {leaf_path(path): d for (path, _), d in zip(leaves, digests)}


def data_digest(data_state) -> str:
  return hashlib.sha256(json.dumps(data_state, sort_keys=True).encode()).hexdigest()


def make(tree, data_state) -> dict:
  """The `digest` item saved beside `state` and `data`."""
  return {"format": FORMAT_VERSION, "algorithm": ALGORITHM, "arrays": tree_digests(tree),
          "data": data_digest(data_state)}


def verify(saved, tree, data_state, where: str) -> None:
  """DigestMismatch naming the first array (or the data position) of `where` whose bytes differ."""
  if not isinstance(saved, dict) or saved.get("algorithm") != ALGORITHM or not isinstance(saved.get("arrays"), dict):
    raise DigestMismatch(f"{where}/digest: not a {ALGORITHM} digest of this checkpoint (damaged digest file)")
  got = tree_digests(tree)
  wanted = saved["arrays"]
  if set(got) != set(wanted):
    raise DigestMismatch(f"{where}/digest lists arrays {sorted(set(wanted) ^ set(got))[:4]} that the restored "
                         "state does not match")
  for name, digest in got.items():
    if digest is not None and wanted[name] is not None and digest != wanted[name]:
      raise DigestMismatch(f"{where}/state: array {name} does not match its {ALGORITHM} digest (saved "
                           f"{str(wanted[name])[:16]}..., read {digest[:16]}...): its bytes were damaged on disk")
  if data_digest(data_state) != saved.get("data"):
    raise DigestMismatch(f"{where}/data/metadata: the data position {json.dumps(data_state)[:100]} does not match "
                         f"its {ALGORITHM} digest: the file was damaged or replaced")


def check_data_position(data_state, template, where: str) -> None:
  """ValueError unless `data_state` has the keys and value types of a fresh iterator's position `template`
  (e.g. {'next_index': int}): a checkpoint of other valid JSON is damage, not a position to resume from."""
  def shape(x):
    if isinstance(x, dict):
      return {k: shape(v) for k, v in x.items()}
    if isinstance(x, list):
      return [shape(v) for v in x]
    return "int" if isinstance(x, int) and not isinstance(x, bool) else type(x).__name__
  if template is not None and shape(data_state) != shape(template):
    raise ValueError(f"{where}/data/metadata: the data position {json.dumps(data_state)[:100]} is not one this "
                     f"run's data iterator can resume from (expected the form {json.dumps(shape(template))})")
