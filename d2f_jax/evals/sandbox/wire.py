"""The sandbox's wire: a data-only encoding of values and length-prefixed JSON frames on a pipe. Standard
library only (the launcher loads it inside the sandbox).

Values are JSON of tagged values: exact builtin types only (None, bool, int, float, complex, str, bytes,
list, tuple, set, frozenset, dict), so a candidate cannot hand the tests an object whose __eq__ always
says True; anything else is an error on the sending side, and anything malformed fails the receiver.
"""

import json
import os

MAX_FRAME = 16 << 20  # bytes of one encoded call or reply
MAX_DEPTH = 200  # nesting of containers in one value


def encode(value, depth=0):
  """A tagged JSON-able form of `value`; TypeError for anything but exact builtin data types."""
  if depth > MAX_DEPTH:
    raise TypeError(f"value nested deeper than {MAX_DEPTH} levels (or self-referencing)")
  kind = type(value)
  if value is None:
    return ["n"]
  if kind is bool:
    return ["b", value]
  if kind is int:
    return ["i", hex(value)]  # hex: no 4300-digit conversion limit
  if kind is float:
    return ["f", value.hex()]  # exact, and keeps nan / inf / -0.0
  if kind is complex:
    return ["c", value.real.hex(), value.imag.hex()]
  if kind is str:
    return ["s", value]
  if kind is bytes:
    return ["y", value.hex()]
  tags = {list: "l", tuple: "t", set: "S", frozenset: "F"}
  if kind in tags:
    return [tags[kind], [encode(v, depth + 1) for v in value]]
  if kind is dict:
    return ["d", [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]]
  raise TypeError(f"a {kind.__module__}.{kind.__qualname__} cannot cross the sandbox boundary "
                  "(only builtin data types can)")


def decode(item, depth=0):
  """Inverse of `encode`; ValueError for anything it would not have produced."""
  if depth > MAX_DEPTH or not isinstance(item, list) or not item or not isinstance(item[0], str):
    raise ValueError("malformed value on the wire")
  tag, rest = item[0], item[1:]

  def one(kind):
    if len(rest) != 1 or not isinstance(rest[0], kind):
      raise ValueError(f"malformed {tag!r} value on the wire")
    return rest[0]

  if tag == "n" and not rest:
    return None
  if tag == "b":
    return one(bool)
  if tag == "i":
    return int(one(str), 16)
  if tag == "f":
    return float.fromhex(one(str))
  if tag == "c" and len(rest) == 2 and all(isinstance(r, str) for r in rest):
    return complex(float.fromhex(rest[0]), float.fromhex(rest[1]))
  if tag == "s":
    return one(str)
  if tag == "y":
    return bytes.fromhex(one(str))
  makers = {"l": list, "t": tuple, "S": set, "F": frozenset}
  if tag in makers:
    return makers[tag](decode(v, depth + 1) for v in one(list))
  if tag == "d":
    pairs = one(list)
    if not all(isinstance(p, list) and len(p) == 2 for p in pairs):
      raise ValueError("malformed dict on the wire")
    return {decode(k, depth + 1): decode(v, depth + 1) for k, v in pairs}
  raise ValueError(f"unknown tag {tag!r} on the wire")


def send(fd, message):
  data = json.dumps(message, ensure_ascii=True).encode()
  if len(data) > MAX_FRAME:
    raise ValueError(f"message of {len(data)} bytes exceeds the {MAX_FRAME}-byte limit")
  data = len(data).to_bytes(4, "big") + data
  while data:
    data = data[os.write(fd, data):]


def receive(fd):
  """One message, or None at end of stream; ValueError for an oversized or broken frame."""
  head = _read_exactly(fd, 4)
  if head is None:
    return None
  size = int.from_bytes(head, "big")
  if size > MAX_FRAME:
    raise ValueError(f"frame of {size} bytes exceeds the {MAX_FRAME}-byte limit")
  body = _read_exactly(fd, size)
  if body is None:
    raise ValueError("stream ended inside a frame")
  return json.loads(body)


def _read_exactly(fd, n):
  chunks, got = [], 0
  while got < n:
    chunk = os.read(fd, n - got)
    if not chunk:
      if got:
        raise ValueError("stream ended inside a frame")
      return None
    chunks.append(chunk)
    got += len(chunk)
  return b"".join(chunks)
