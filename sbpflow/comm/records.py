"""Fixed-size binary records: the wire form of small tagged messages such as the runtime's
``req`` and ``ack``, packed with one `struct` call and read with one ``unpack_from``.

A message is a record when it is a tuple ``(tag, n_1, ..., n_k)`` or ``(tag, n_1, ..., n_k,
value)``: ``tag`` one of `TAGS`, 1 <= k <= `MAX_INTS` ints (``type(n) is int``, within int64),
and at most one trailing value of any other kind (None, or plain data and tensors, which
`wire` pickles after the record, restricted as any body). Its body is `HEAD` (tag code, k, the
value's kind, `MAX_INTS` int64s, those past k zero), then the pickled value if any; the frame
says so with `wire.RECORD` in its buffer count. `unpack` checks every field (an unknown tag or
value kind, k out of range, a nonzero unused int, a body of the wrong size: `WireError`), so
a record decodes to exactly the tuple that was sent. See docs/runtime.md, 'Message channels'.
"""

from __future__ import annotations

import struct
from typing import Any

from ..errors import WireError

__all__ = ["TAGS", "MAX_INTS", "HEAD", "ABSENT", "NONE", "PICKLED", "pack", "unpack"]

TAGS = ("req", "ack")  # a record's tag: its code is its index + 1
MAX_INTS = 8
HEAD = struct.Struct(f"!BBB{MAX_INTS}q")  # tag code, int count, value kind, the ints
ABSENT, NONE, PICKLED = 0, 1, 2  # the value after the ints: none, None, pickled after HEAD
_CODES = {t: i + 1 for i, t in enumerate(TAGS)}
# the element types of a record's tag and ints -> k (exact types: a bool is no int here)
_SHAPES = {(str,) + (int,) * k: k for k in range(1, MAX_INTS + 1)}
# per k: HEAD with the unused ints as zero bytes (one pack call)
_PACK = {k: struct.Struct(f"!BBB{k}q{8 * (MAX_INTS - k)}x") for k in range(1, MAX_INTS + 1)}
_ZEROS = (0,) * MAX_INTS


def pack(message: Any) -> tuple[bytes, int, Any] | None:
    """``(head, value kind, value)`` of a record ``message`` (the value to pickle after the
    head when the kind is `PICKLED`), or None when ``message`` is no record."""
    if type(message) is not tuple:
        return None
    types = tuple(map(type, message))
    k = _SHAPES.get(types)
    if k is not None:
        kind, value, ints = ABSENT, None, message[1:]
    else:
        k = _SHAPES.get(types[:-1])
        if k is None:
            return None
        value, ints = message[-1], message[1:-1]
        kind = NONE if value is None else PICKLED
    code = _CODES.get(message[0])
    if code is None:
        return None
    try:
        return _PACK[k].pack(code, k, kind, *ints), kind, value
    except struct.error:  # an int outside int64
        return None


def unpack(data: Any, offset: int, size: int) -> tuple[tuple, int]:
    """``(the record's tag and ints, its value kind)`` from the ``size`` body bytes at
    ``offset`` of ``data`` (a `PICKLED` value lies after `HEAD`); `WireError` for a body that
    is not a record's."""
    if size < HEAD.size:
        raise WireError(f"a record of {size} bytes, shorter than its {HEAD.size}-byte head")
    fields = HEAD.unpack_from(data, offset)
    code, k, kind = fields[0], fields[1], fields[2]
    if not 0 < code <= len(TAGS) or not 0 < k <= MAX_INTS or \
            (k < MAX_INTS and fields[3 + k:] != _ZEROS[k:]):
        raise WireError(f"a record with tag code {code} (known: 1..{len(TAGS)}) and {k} ints "
                        f"(1..{MAX_INTS}, those past them zero): {fields[3:]}")
    if kind == ABSENT and size == HEAD.size:
        return (TAGS[code - 1],) + fields[3:3 + k], kind
    if kind == NONE and size == HEAD.size:
        return (TAGS[code - 1],) + fields[3:3 + k] + (None,), kind
    if kind == PICKLED and size > HEAD.size:
        return (TAGS[code - 1],) + fields[3:3 + k], kind
    raise WireError(f"a record of value kind {kind} (known: 0..2) and {size} bytes")
