"""SBP layouts: split, broadcast, partial, and the shard math of an nd-sbp.

An *sbp* says how a tensor is laid out along one mesh dimension: ``S(a)`` split (rank ``i`` of
``m`` keeps balanced part ``i`` along axis ``a``), ``B`` broadcast (every rank keeps the whole
piece), ``P(op)`` partial (the piece is the ``op``-reduction, ``sum``, ``max`` or ``min``, of
what the ranks hold). An *nd-sbp* is a tuple of sbps, one per mesh dimension; the local shard
of a rank applies them in order (``shard_box``), the one definition every other module uses
(docs/design.md, 'The local-shard rule').

    >>> from sbpflow.sbp import S, B, P, parse_nd_sbp
    >>> parse_nd_sbp("S(0), B", 2)
    (S(0), B)
    >>> P("max")
    P(max)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Sequence, Union

from .errors import SbpParseError, SplitAxisError

__all__ = [
    "Sbp", "Split", "Broadcast", "Partial", "S", "B", "P", "split", "broadcast", "partial_sum",
    "partial_max", "partial_min", "NdSbp", "SbpLike", "parse_sbp", "parse_nd_sbp", "dual",
    "dual_nd", "part", "shard_box", "local_shape", "format_nd_sbp", "check_axes", "Box",
    "REDUCE_OPS", "holds_value",
]

REDUCE_OPS = ("sum", "max", "min")  # the reductions of P(op) and of the reducing collectives


class Sbp:
    """Base of the three sbp kinds; instances are small immutable values."""

    __slots__ = ()

    @property
    def is_split(self) -> bool:
        return isinstance(self, Split)

    @property
    def is_broadcast(self) -> bool:
        return isinstance(self, Broadcast)

    @property
    def is_partial(self) -> bool:
        return isinstance(self, Partial)


@dataclass(frozen=True, slots=True)
class Split(Sbp):
    """``S(axis)``: balanced split of tensor axis ``axis`` over the mesh dimension."""

    axis: int

    def __post_init__(self) -> None:
        if not isinstance(self.axis, int) or isinstance(self.axis, bool) or self.axis < 0:
            raise SbpParseError(f"S(axis) needs a non-negative int axis, got {self.axis!r}")

    def __repr__(self) -> str:
        return f"S({self.axis})"

    def __hash__(self) -> int:   # (the generated one builds a tuple: searches hash millions)
        return self.axis


@dataclass(frozen=True, slots=True)
class Broadcast(Sbp):
    """``B``: every rank of the mesh dimension holds the whole piece."""

    def __repr__(self) -> str:
        return "B"

    def __hash__(self) -> int:
        return -3


@dataclass(frozen=True, slots=True)
class Partial(Sbp):
    """``P(op)``: the piece is the ``op``-reduction of the ranks' values (``sum`` by default).

    ``sf.P`` is ``P(sum)``; calling it, ``sf.P("max")``, gives another reduction.
    """

    op: str = "sum"

    def __post_init__(self) -> None:
        if self.op not in REDUCE_OPS:
            raise SbpParseError(f"P(op): op must be one of {REDUCE_OPS}, got {self.op!r}")

    def __call__(self, op: str = "sum") -> "Partial":
        return Partial(op)

    def __repr__(self) -> str:
        return "P" if self.op == "sum" else f"P({self.op})"

    def __hash__(self) -> int:
        return -4 if self.op == "sum" else -5 if self.op == "max" else -6


S = Split
B = Broadcast()
P = Partial("sum")


def split(axis: int) -> Split:
    """OneFlow-style alias of ``S(axis)``."""
    return Split(axis)


broadcast = B
partial_sum = P
partial_max = Partial("max")
partial_min = Partial("min")

NdSbp = tuple  # tuple[Sbp, ...]; kept as a plain tuple so it hashes and prints simply
SbpLike = Union[Sbp, str, Sequence[Union[Sbp, str]]]

_SPLIT_RE = re.compile(r"^S\(\s*(\d+)\s*\)$")
_PARTIAL_RE = re.compile(r"^P(?:\(\s*(sum|max|min)\s*\))?$")


def parse_sbp(value: Sbp | str) -> Sbp:
    """One sbp from an ``Sbp`` or a string: ``"S(0)"``, ``"B"``, ``"P"``, ``"P(max)"``."""
    if isinstance(value, Sbp):
        return value
    if isinstance(value, str):
        text = value.strip()
        if text == "B":
            return B
        m = _SPLIT_RE.match(text)
        if m:
            return Split(int(m.group(1)))
        m = _PARTIAL_RE.match(text)
        if m:
            return Partial(m.group(1) or "sum")
        raise SbpParseError(
            f"unknown sbp {value!r}; write 'S(<axis>)', 'B', 'P', 'P(max)' or 'P(min)'")
    raise SbpParseError(f"expected an sbp (sf.S(0), sf.B, sf.P) or its string, got {value!r}")


def parse_nd_sbp(value: SbpLike, ndim: int | None = None) -> tuple[Sbp, ...]:
    """An nd-sbp tuple from an sbp, a string (``"S(0), B"`` or ``"(S(0), B)"``) or a sequence.

    A single sbp is a 1-tuple. With ``ndim`` given, the length must equal the mesh's ndim.
    """
    if isinstance(value, str) and ("," in value or value.strip().startswith("(")):
        text = value.strip()
        if text.startswith("(") and text.endswith(")") and not _SPLIT_RE.match(text):
            text = text[1:-1]
        items: list = [t for t in _split_top_level(text) if t.strip()]
    elif isinstance(value, (Sbp, str)):
        items = [value]
    elif isinstance(value, Iterable):
        items = list(value)
    else:
        raise SbpParseError(f"expected an sbp or a tuple of sbps, got {value!r}")
    result = tuple(parse_sbp(v) for v in items)
    if not result:
        raise SbpParseError("an nd-sbp needs at least one sbp")
    if ndim is not None and len(result) != ndim:
        raise SbpParseError(
            f"nd-sbp {format_nd_sbp(result)} has {len(result)} entries but the mesh has {ndim} "
            f"dimension(s); give one sbp per mesh dimension")
    return result


def _split_top_level(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return parts


def format_nd_sbp(nd_sbp: Sequence[Sbp]) -> str:
    inner = ", ".join(repr(s) for s in nd_sbp)
    return f"({inner},)" if len(nd_sbp) == 1 else f"({inner})"


def dual(s: Sbp) -> Sbp:
    """The gradient's layout of a tensor laid out as ``s``: S↔S, B↔P(sum).

    ``P(max)``/``P(min)`` carry no gradient; asking for their dual is an error.
    """
    if isinstance(s, Split):
        return s
    if isinstance(s, Broadcast):
        return P
    if s.op != "sum":
        raise SbpParseError(f"{s!r} carries no gradient; it has no dual layout")
    return B


def dual_nd(nd_sbp: Sequence[Sbp]) -> tuple[Sbp, ...]:
    """`dual` of each entry: the nd-sbp of the gradient of a tensor laid out as ``nd_sbp``.

    >>> dual_nd((S(0), B, P))
    (S(0), P, B)
    """
    return tuple(dual(s) for s in nd_sbp)


def check_axes(nd_sbp: Sequence[Sbp], tensor_ndim: int, *, shape=None, placement=None) -> None:
    """Raise `SplitAxisError` if some ``S(a)`` has ``a >= tensor_ndim``."""
    for s in nd_sbp:
        if isinstance(s, Split) and s.axis >= tensor_ndim:
            where = f" of a tensor of shape {tuple(shape)}" if shape is not None else ""
            on = f" on {placement}" if placement is not None else ""
            raise SplitAxisError(
                f"sbp {format_nd_sbp(nd_sbp)}{on}: split axis {s.axis} is out of range{where} "
                f"({tensor_ndim} dimension(s)); use an axis in 0..{max(tensor_ndim - 1, 0)} or B")


def part(n: int, m: int, i: int) -> tuple[int, int]:
    """Balanced part ``i`` of ``m`` of a length ``n``: (start, size).

    Part ``i`` has ``n // m + (1 if i < n % m else 0)`` elements; parts are in order.
    """
    q, r = divmod(n, m)
    return i * q + min(i, r), q + (1 if i < r else 0)


Box = tuple  # tuple[tuple[int, int], ...]: (start, size) per tensor axis (`sbpflow.boxing.boxes`)


def shard_box(shape: Sequence[int], mesh_shape: Sequence[int], nd_sbp: Sequence[Sbp],
              coord: Sequence[int]) -> Box:
    """The region of the logical tensor held by the rank at mesh coordinate ``coord``.

    Returns ``((start, size), ...)`` per tensor axis. For ``P`` dimensions the rank holds a
    partial value of that region; for ``B`` the region is unchanged.
    """
    box = [(0, int(n)) for n in shape]
    for sbp, m, c in zip(nd_sbp, mesh_shape, coord):
        if isinstance(sbp, Split):
            start, size = box[sbp.axis]
            off, sz = part(size, m, c)
            box[sbp.axis] = (start + off, sz)
    return tuple(box)


def local_shape(shape: Sequence[int], mesh_shape: Sequence[int], nd_sbp: Sequence[Sbp],
                coord: Sequence[int]) -> tuple[int, ...]:
    """Shape of the local shard at mesh coordinate ``coord``."""
    return tuple(size for _, size in shard_box(shape, mesh_shape, nd_sbp, coord))


def holds_value(nd_sbp: Sequence[Sbp], coord: Sequence[int],
                dims: Iterable[int] | None = None) -> bool:
    """Whether the rank at mesh coordinate ``coord`` holds the value when a whole value is laid
    out as a partial ``nd_sbp`` (looking only at mesh ``dims``; default all).

    The one rule for every place that makes partial shards from whole values (creation ops,
    ``sf.nn.init``, checkpoint loading, boxing ``B -> P``): along a ``P(sum)`` dim only
    coordinate 0 holds the value and the others hold zeros, the sum's identity; along
    ``P(max)`` / ``P(min)`` every rank holds it (the max of equal values is the value), so no
    infinity ever appears in a shard. A rank that does not hold the value holds zeros.
    """
    dims = range(len(nd_sbp)) if dims is None else dims
    return not any(isinstance(nd_sbp[d], Partial) and nd_sbp[d].op == "sum" and coord[d] != 0
                   for d in dims)
