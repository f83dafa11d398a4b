"""Fuzzing the checkpoint readers: seeded random mutations of a tiny valid LLaDA checkpoint never load wrong
weights silently. Each mutated checkpoint either raises the project's error type (ConvertError, whose
message names the file) or loads tensors bit-identical to the original.

Mutated: single bytes of the safetensors header (its 8-byte length and JSON), structured header edits
(dtype, shape, offsets, names, dropped or duplicated entries) and single bytes of config.json. The data
region is not fuzzed for refusal: safetensors carries no checksum, so a flipped data byte is a different
weight by design; instead the reader must return exactly the bytes in the file (checked once, exactly).
"""

import json
import os
import shutil
import struct

import numpy as np
import pytest

from d2f_jax.convert import load_hf_params, synthetic
from d2f_jax.convert.errors import ConvertError
from d2f_jax.models import TINY_LLADA

CASES = 300


@pytest.fixture(scope="module")
def original(tmp_path_factory):
  path = tmp_path_factory.mktemp("fuzz_src")
  synthetic.write_hf_checkpoint(path, TINY_LLADA.replace(num_layers=1), seed=0, dtype="float32", tokenizer=False)
  [weights] = [n for n in os.listdir(path) if n.endswith(".safetensors")]
  _, params = load_hf_params(str(path), progress=False)
  return path, weights, _flat(params)


def _flat(tree, prefix=""):
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      out.update(_flat(value, f"{prefix}{key}/"))
    else:
      out[prefix + key] = np.asarray(value)
  return out


def _header(blob: bytes) -> tuple[int, dict]:
  (size,) = struct.unpack("<Q", blob[:8])
  return size, json.loads(blob[8:8 + size])


def _with_header(blob: bytes, header: dict) -> bytes:
  size, _ = _header(blob)
  text = json.dumps(header).encode()
  text += b" " * (-len(text) % 8)
  return struct.pack("<Q", len(text)) + text + blob[8 + size:]


def _structured(blob: bytes, rng) -> bytes:
  """One edit of the parsed header that keeps it valid JSON."""
  _, header = _header(blob)
  names = sorted(k for k in header if k != "__metadata__")
  name = names[rng.integers(len(names))]
  entry = header[name]
  kind = rng.integers(7)
  if kind == 0:
    entry["dtype"] = str(rng.choice(["F16", "BF16", "I32", "F64", "U8", "BOOL", "F8_E4M3", "XX"]))
  elif kind == 1:
    entry["shape"] = [int(d) + int(rng.choice([-1, 1])) for d in entry["shape"]]
  elif kind == 2:
    shift = int(rng.choice([-8, -4, -1, 1, 4, 8]))
    entry["data_offsets"] = [o + shift for o in entry["data_offsets"]]
  elif kind == 3:
    other = header[names[(names.index(name) + 1) % len(names)]]
    entry["data_offsets"] = list(other["data_offsets"])  # two tensors on the same bytes
  elif kind == 4:
    header[name + "x"] = header.pop(name)  # renamed
  elif kind == 5:
    del header[name]
  else:
    entry["shape"] = list(reversed(entry["shape"]))
  return _with_header(blob, header)


def _mutate(src, weights, dst, rng) -> str:
  shutil.copytree(src, dst)
  kind = rng.integers(3)
  if kind == 2:
    path = os.path.join(dst, "config.json")
    data = bytearray(open(path, "rb").read())
    data[rng.integers(len(data))] = int(rng.integers(256))
    open(path, "wb").write(bytes(data))
    return "config byte"
  path = os.path.join(dst, weights)
  blob = open(path, "rb").read()
  if kind == 0:
    size, _ = _header(blob)
    data = bytearray(blob)
    data[rng.integers(8 + size)] = int(rng.integers(256))
    blob = bytes(data)
  else:
    blob = _structured(blob, rng)
  open(path, "wb").write(blob)
  return "header byte" if kind == 0 else "header edit"


def test_mutations_are_refused_or_load_identical_weights(original, tmp_path):
  src, weights, reference = original
  rng = np.random.default_rng(20261203)
  outcomes = {}
  for case in range(CASES):
    what = _mutate(src, weights, tmp_path / f"case{case}", rng)
    try:
      _, params = load_hf_params(str(tmp_path / f"case{case}"), progress=False)
    except ConvertError as e:
      assert str(tmp_path / f"case{case}") in str(e) or "config.json" in str(e) or weights in str(e), (what, e)
      outcomes[(what, "refused")] = outcomes.get((what, "refused"), 0) + 1
    else:
      got = _flat(params)
      assert got.keys() == reference.keys(), what
      for key in reference:
        assert got[key].dtype == reference[key].dtype and got[key].tobytes() == reference[key].tobytes(), (what, key)
      outcomes[(what, "identical")] = outcomes.get((what, "identical"), 0) + 1
    shutil.rmtree(tmp_path / f"case{case}")
  # The fuzzer reaches both outcomes for the header: it really corrupts, and really leaves harmless bytes.
  assert outcomes.get(("header edit", "refused"), 0) > 50, outcomes
  assert outcomes.get(("header byte", "refused"), 0) > 10, outcomes


def test_a_flipped_data_byte_reads_exactly_the_bytes_in_the_file(original, tmp_path):
  src, weights, reference = original
  shutil.copytree(src, tmp_path / "c")
  path = tmp_path / "c" / weights
  blob = bytearray(path.read_bytes())
  size, header = _header(bytes(blob))
  entry = header["model.transformer.wte.weight"]
  start = 8 + size + entry["data_offsets"][0]
  blob[start + 3] ^= 0x40  # the top byte of element 0 (little-endian float32)
  path.write_bytes(bytes(blob))
  _, params = load_hf_params(str(tmp_path / "c"), progress=False)
  got, want = _flat(params)["embedding"], reference["embedding"].copy()
  want.view(np.uint8).reshape(-1)[3] ^= 0x40
  assert got.tobytes() == want.tobytes()
