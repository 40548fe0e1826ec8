"""The collective kinds: the one table the Communicator, the boxing planner and the cost model read.

Per kind (`Kind`: all_gather, reduce_scatter, all_reduce, all_to_all, broadcast, p2p): what the
bytes ``n`` of its cost formula are, its α count and nominal per-rank volume on a group of
``p``, whether it applies a reduction (`REDUCE_OPS`), and its exact per-member traffic, uneven
pieces included, in elements. See docs/internals.md, 'Collective kinds' (the table).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

from ..sbp import REDUCE_OPS, part

__all__ = ["Kind", "Form", "Traffic", "TABLE", "KINDS", "BOXING_KINDS", "MEASURED_KINDS",
           "LINEAR_KINDS", "VARIANTS", "ALGORITHMS", "REDUCE_OPS", "gather_traffic",
           "scatter_traffic", "ring_traffic", "exchange_traffic", "broadcast_traffic"]


class Traffic(NamedTuple):
    """Elements one member sends and receives in one collective."""

    sent: int
    recv: int


def gather_traffic(i: int, sizes: Sequence[int]) -> Traffic:
    """all_gather: ``sizes[j]`` elements are member j's piece; every member sends its piece to
    each other member and receives theirs."""
    return Traffic((len(sizes) - 1) * sizes[i], sum(sizes) - sizes[i])


def scatter_traffic(i: int, sizes: Sequence[int]) -> Traffic:
    """reduce_scatter: ``sizes[j]`` elements are member j's result; every member sends its
    input's piece j to member j and receives piece i from each other member."""
    return Traffic(sum(sizes) - sizes[i], (len(sizes) - 1) * sizes[i])


def ring_traffic(i: int, p: int, numel: int) -> Traffic:
    """all_reduce of a tensor of ``numel`` elements on ``p`` members: reduce-scatter then
    all-gather over balanced chunks (`sbpflow.sbp.part`); member i sends every other member its
    chunk and their chunk once each."""
    chunk = part(numel, p, i)[1]
    moved = numel - chunk + (p - 1) * chunk
    return Traffic(moved, moved)


def exchange_traffic(i: int, out: Sequence[int], inc: Sequence[int]) -> Traffic:
    """all_to_all: ``out[j]`` elements go to member j, ``inc[j]`` come from member j (a
    member's piece for itself stays)."""
    return Traffic(sum(out) - out[i], sum(inc) - inc[i])


def broadcast_traffic(i: int, p: int, numel: int, src: int) -> Traffic:
    """broadcast of ``numel`` elements from member ``src``: the source sends each other member
    the message (the bytes a flat broadcast moves; the cost model times a tree or a pipeline)."""
    return Traffic((p - 1) * numel, 0) if i == src else Traffic(0, numel)


def _p2p_traffic(sends: Sequence[int], recvs: Sequence[int]) -> Traffic:
    """p2p: the messages a member sends and receives, as they are."""
    return Traffic(sum(sends), sum(recvs))


class Form(NamedTuple):
    """A kind's (or variant's) linear alpha-beta form on ``p`` ranks: ``messages(p)`` α terms
    and ``volume(p)·n`` bytes each member sends (and receives)."""

    messages: Callable[[int], int]
    volume: Callable[[int], float]


class Kind(NamedTuple):
    """One collective kind. ``form`` is None for a kind with no linear alpha-beta form
    (broadcast: tree or pipeline). ``traffic`` is its exact per-member rule (arguments per
    kind: see the function). ``boxing``: a same-placement boxing step of this kind exists;
    ``measured``: calibration times and fits it."""

    name: str
    about: str
    form: Form | None
    reduces: bool
    boxing: bool
    measured: bool
    traffic: Callable[..., Traffic]


_RING = Form(lambda p: p - 1, lambda p: (p - 1) / p)
TABLE: dict[str, Kind] = {k.name: k for k in (
    Kind("all_gather", "the gathered result", _RING, False, True, True, gather_traffic),
    Kind("reduce_scatter", "one member's input", _RING, True, True, True, scatter_traffic),
    Kind("all_reduce", "one member's tensor",
         Form(lambda p: 2 * (p - 1), lambda p: 2 * (p - 1) / p), True, True, True, ring_traffic),
    Kind("all_to_all", "one member's input", _RING, False, True, True, exchange_traffic),
    Kind("broadcast", "the message", None, False, False, False, broadcast_traffic),
    Kind("p2p", "one message", Form(lambda p: p - 1, lambda p: float(p - 1)), False, False, True,
         _p2p_traffic),
)}

KINDS = tuple(TABLE)
BOXING_KINDS = tuple(k for k, v in TABLE.items() if v.boxing)
MEASURED_KINDS = tuple(k for k, v in TABLE.items() if v.measured)
LINEAR_KINDS = tuple(k for k, v in TABLE.items() if v.form is not None)

# Algorithm variants a per-kind fit may name instead of the kind's form. "direct" all-reduce:
# every member receives every other member's whole tensor and reduces them itself ((p-1)·n a
# member instead of the ring's 2(p-1)/p·n; the in-process threads backend works this way).
VARIANTS: dict[tuple[str, str], Form] = {
    ("all_reduce", "direct"): Form(lambda p: p - 1, lambda p: float(p - 1)),
}
ALGORITHMS = tuple(sorted({a for _, a in VARIANTS}))
