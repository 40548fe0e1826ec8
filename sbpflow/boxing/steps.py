"""Boxing steps as data: what one step changes, which collective it is, and what it moves.

See docs/internals.md, 'Boxing steps'.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from ..caches import memoize
from ..comm.kinds import (BOXING_KINDS, TABLE, Traffic, exchange_traffic, gather_traffic,
                          ring_traffic, scatter_traffic)
from ..errors import BoxingError
from ..placement import Placement
from ..sbp import Broadcast, Partial, Sbp, Split, dual_nd, format_nd_sbp, shard_box
from .boxes import Box, box_numel, intersect

__all__ = ["BoxingStep", "classify", "is_valid_move", "step_bytes", "dual_step", "member_boxes",
           "member_traffic", "placement_groups", "is_local_change", "COLLECTIVE_KINDS"]

COLLECTIVE_KINDS = BOXING_KINDS  # the kinds a same-placement step may be (`sbpflow.comm.kinds`)


@dataclass(frozen=True)
class BoxingStep:
    """One boxing step: ``kind`` turns a tensor of ``shape`` from ``src_sbp`` (an nd-sbp) on
    ``src_placement`` to ``dst_sbp`` on ``dst_placement`` (the same placement unless a
    transfer). ``nbytes`` is the total moved, summed over ranks."""

    kind: str
    shape: tuple
    src_placement: Placement
    src_sbp: tuple
    dst_placement: Placement
    dst_sbp: tuple
    dims: tuple = ()
    op: str = "sum"
    routes: tuple = ()
    itemsize: int = 4
    nbytes: int = field(default=0, compare=False)

    @property
    def same_placement(self) -> bool:
        """Whether source and destination share the placement (every kind but ``transfer``)."""
        return self.kind != "transfer"

    @property
    def differentiable(self) -> bool:
        """Whether the step has a dual (False when it involves ``P(max)`` / ``P(min)``)."""
        return all(not (isinstance(s, Partial) and s.op != "sum")
                   for s in self.src_sbp + self.dst_sbp)

    def describe(self) -> str:
        """One line for a plan's printout: the kind, the mesh dims or placements, the sbps and
        the bytes."""
        if self.kind == "transfer":
            n = sum(1 for s, d, _ in self.routes if s != d)
            where = f"{self.src_placement} -> {self.dst_placement}, {n} message(s)"
            return (f"{'transfer':<15}{where}  {format_nd_sbp(self.src_sbp)} -> "
                    f"{format_nd_sbp(self.dst_sbp)}")
        reduces = self.kind in TABLE and TABLE[self.kind].reduces
        kind = self.kind + (f"({self.op})" if reduces and self.op != "sum" else "")
        return (f"{kind:<15}mesh dims {self.dims}  {format_nd_sbp(self.src_sbp)} -> "
                f"{format_nd_sbp(self.dst_sbp)}")


def classify(src: Sequence[Sbp], dst: Sequence[Sbp], dims: Sequence[int]) -> tuple[str, str] | None:
    """(kind, op) of changing ``src`` to ``dst`` on ``dims``; None if no single step does it."""
    a = [src[d] for d in dims]
    b = [dst[d] for d in dims]
    if all(isinstance(s, Partial) for s in a) and len({s.op for s in a}) == 1:
        op = a[0].op
        if all(isinstance(s, Broadcast) for s in b):
            return "all_reduce", op
        if all(isinstance(s, Split) for s in b):
            return "reduce_scatter", op
    if all(isinstance(s, Split) for s in a):
        if all(isinstance(s, Broadcast) for s in b):
            return "all_gather", "sum"
        if all(isinstance(s, Split) and s != t for s, t in zip(b, a)):
            return "all_to_all", "sum"
    if all(is_local_change(s, t) for s, t in zip(a, b)):
        ops = {t.op for s, t in zip(a, b) if isinstance(t, Partial) and s != t}
        return "local", (ops.pop() if len(ops) == 1 else "sum")
    return None


def is_local_change(s: Sbp, t: Sbp) -> bool:
    """Whether one mesh dim goes from ``s`` to ``t`` without communication: unchanged, ``B`` to
    ``S`` / ``P`` (slice / keep), ``S`` to ``P`` (shard into an identity-filled region). A
    partial never changes its reduction locally (``P(sum) -> P(max)`` is reduced first)."""
    if s == t:
        return True
    if isinstance(s, Broadcast):
        return isinstance(t, (Split, Partial))
    return isinstance(s, Split) and isinstance(t, Partial)


def is_valid_move(src: Sequence[Sbp], dst: Sequence[Sbp], dims: Sequence[int]) -> bool:
    """No mesh dim outside ``dims`` after ``min(dims)`` splits an axis the move touches.
    (Plain loops: the search asks it once per phase of every layout pair it prices.)"""
    touched = set()
    for d in dims:
        a, b = src[d], dst[d]
        if isinstance(a, Split):
            touched.add(a.axis)
        if isinstance(b, Split):
            touched.add(b.axis)
    for e in range(min(dims) + 1, len(src)):
        x = src[e]
        if isinstance(x, Split) and x.axis in touched and e not in dims:
            return False
    return True


@memoize(65536)
def member_boxes(shape: tuple, placement: Placement, nd_sbp: tuple) -> dict[int, Box]:
    """Box of every rank of ``placement`` under ``nd_sbp``."""
    return {placement.rank_at(c): shard_box(shape, placement.shape, nd_sbp, c)
            for c in placement.coords()}


@memoize(4096)
def placement_groups(placement: Placement, dims: tuple) -> tuple[tuple[int, ...], ...]:
    """The disjoint sub-groups of ranks that differ only along ``dims``, in mesh order."""
    seen, out = set(), []
    for c in placement.coords():
        g = placement.group(dims, c)
        if g not in seen:
            seen.add(g)
            out.append(g)
    return tuple(out)


def member_traffic(step: BoxingStep, group: Sequence[int]) -> list[Traffic]:
    """Elements each member of ``group`` sends and receives in the same-placement collective
    ``step``: the kind's rule of `sbpflow.comm.kinds` applied to the members' boxes, exactly
    what the Communicator counts when the step runs (uneven shards included)."""
    pl = step.src_placement
    src = member_boxes(step.shape, pl, step.src_sbp)
    dst = member_boxes(step.shape, pl, step.dst_sbp)
    p = len(group)
    if step.kind == "all_gather":
        sizes = [box_numel(src[r]) for r in group]
        return [gather_traffic(i, sizes) for i in range(p)]
    if step.kind == "reduce_scatter":
        sizes = [box_numel(dst[r]) for r in group]
        return [scatter_traffic(i, sizes) for i in range(p)]
    if step.kind == "all_reduce":
        return [ring_traffic(i, p, box_numel(src[r])) for i, r in enumerate(group)]
    if step.kind == "all_to_all":
        moves = [[box_numel(intersect(src[a], dst[b])) for b in group] for a in group]
        return [exchange_traffic(i, moves[i], [row[i] for row in moves]) for i in range(p)]
    raise BoxingError(f"{step.describe()}: {step.kind!r} is not a collective step; "
                      f"one of {COLLECTIVE_KINDS}")


def step_bytes(step: BoxingStep) -> int:
    """Bytes the step moves, summed over ranks (exact, uneven shards included)."""
    if step.kind == "transfer":
        return step.itemsize * sum(box_numel(b) for s, d, b in step.routes if s != d)
    if step.kind == "local":
        return 0
    total = sum(t.sent for g in placement_groups(step.src_placement, step.dims)
                for t in member_traffic(step, g))
    return total * step.itemsize


@memoize(1 << 16)
def make_step(shape: tuple, placement: Placement, src: tuple, dst: tuple, dims: tuple,
              itemsize: int) -> BoxingStep:
    kind, op = classify(src, dst, dims)
    step = BoxingStep(kind, shape, placement, src, placement, dst, dims, op, (), itemsize)
    return _with_bytes(step)


def _with_bytes(step: BoxingStep) -> BoxingStep:
    object.__setattr__(step, "nbytes", step_bytes(step))
    return step


@memoize(4096)
def dual_step(step: BoxingStep) -> BoxingStep:
    """The step backward runs: ``dual(dst) -> dual(src)`` (transfers: routes transposed)."""
    src, dst = dual_nd(step.dst_sbp), dual_nd(step.src_sbp)
    if step.kind == "transfer":
        routes = tuple((d, s, b) for s, d, b in step.routes)
        return _with_bytes(BoxingStep("transfer", step.shape, step.dst_placement, src,
                                step.src_placement, dst, (), "sum", routes, step.itemsize))
    return make_step(step.shape, step.src_placement, src, dst, step.dims, step.itemsize)
