"""Plan a redistribution (boxing) between two layouts (`sf.Layout`), least bytes first.

Same placement: a shortest path over nd-sbp states, whose edges are the single steps of
`sbpflow.boxing.steps` on any set of mesh dims at once (so ``(P, P) -> (B, B)`` is one
all-reduce over 4 ranks, and ``(S(0), S(1)) -> (S(1), S(0))`` one all-to-all of shards).
Path cost is ``(bytes, uses point-to-point, steps)``: fewest bytes, then collectives over
point-to-point, then fewest steps.

Any placements (also used on the same placement when it moves fewer bytes): reduce a partial
source on its own devices first (to the split or broadcast layout that makes the total least),
then a point-to-point *transfer* sends each destination rank exactly the regions it needs.
A destination rank that already holds a region copies it locally.

Plans are cached by (shape, dtype, src, dst).
"""

from __future__ import annotations

import heapq
import itertools
import threading
import warnings
from dataclasses import dataclass
from typing import Sequence

import torch

from ..caches import memoize
from ..errors import BoxingError
from ..layouts import Layout, as_layout
from ..placement import Placement
from ..sbp import B, Broadcast, Partial, Split, check_axes, holds_value
from .boxes import box_numel, intersect
from .steps import BoxingStep, _with_bytes, is_valid_move, make_step, member_boxes

__all__ = ["BoxingPlan", "plan", "plan_layouts"]


@dataclass(frozen=True)
class BoxingPlan:
    """The steps that turn layout ``src`` into ``dst`` and the bytes they move (summed over
    ranks). ``src`` and ``dst`` are `Layout` values, equal to the ``(placement, nd-sbp)`` pairs
    `plan` takes (a `BoxingStep` names their halves: ``src_placement``, ``src_sbp``)."""

    shape: tuple
    dtype: torch.dtype
    src: Layout
    dst: Layout
    steps: tuple

    @property
    def nbytes(self) -> int:
        """Bytes the steps move, summed over ranks (its time on a cluster: `sf.cost.plan_time`)."""
        return sum(s.nbytes for s in self.steps)

    @property
    def differentiable(self) -> bool:
        """Whether every step has a dual, so the plan's result keeps its gradient."""
        return all(s.differentiable for s in self.steps)

    def all_reduce_group(self, rank: int) -> tuple | None:
        """When the plan is one all-reduce (``steps[0]``) on a placement holding ``rank``: the
        ranks ``rank`` reduces with (its group along the step's mesh dims); else None."""
        pl = self.src.placement
        if len(self.steps) != 1 or self.steps[0].kind != "all_reduce" or rank not in pl:
            return None
        return pl.group(self.steps[0].dims, pl.coord_of(rank))

    def __str__(self) -> str:
        dt = str(self.dtype).replace("torch.", "")
        lines = [f"boxing {tuple(self.shape)} {dt}: {self.src} -> {self.dst}"]
        if not self.steps:
            lines.append("  (no step: layouts are equal)")
        for i, s in enumerate(self.steps, 1):
            lines.append(f"  {i}. {s.describe()}  {_fmt_bytes(s.nbytes)}")
        lines.append(f"  total {_fmt_bytes(self.nbytes)} moved" +
                     ("" if self.differentiable else "  (forward only: P(max)/P(min) carry no gradient)"))
        return "\n".join(lines)

    __repr__ = __str__


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit} ({n} B)"
    return f"{n} B"


def plan(shape: Sequence[int], dtype: torch.dtype, src: Layout | tuple,
         dst: Layout | tuple) -> BoxingPlan:
    """Plan boxing of a tensor of ``shape``/``dtype`` from layout ``src`` to ``dst``.

    Each layout is a `Layout` or a ``(placement, sbp)`` pair whose sbp may be a single sbp
    (1-D mesh), a tuple, or a string such as ``"S(0), B"``; both forms give the same plan.
    Nothing runs; the plan lists its steps and the bytes each moves.
    """
    shape = tuple(int(s) for s in shape)
    src, dst = as_layout(src), as_layout(dst)
    for lay in (src, dst):
        check_axes(lay.sbp, len(shape), shape=shape, placement=lay.placement)
    return plan_layouts(shape, dtype, src, dst)


_PLAN_LOCK = threading.Lock()


def plan_layouts(shape: tuple, dtype: torch.dtype, src: Layout, dst: Layout,
                 *quartet) -> BoxingPlan:
    """`plan` on parsed, checked layouts: `Layout` values (``t.global_layout``,
    ``Layout.parsed``) or the ``(placement, nd-sbp)`` pairs equal to them, which share the
    cache (rank threads asking for the same plan at once wait for the first instead of each
    planning it). The old form ``plan_layouts(shape, dtype, spl, ssbp, dpl, dsbp)`` works for
    one release, with a DeprecationWarning."""
    if quartet:
        src, dst = _from_quartet(src, dst, quartet)
    with _PLAN_LOCK:
        return _plan_layouts(shape, dtype, src, dst)


def _from_quartet(spl: Placement, ssbp: tuple, rest: tuple) -> tuple[tuple, tuple]:
    if len(rest) != 2:
        raise TypeError(f"plan_layouts(shape, dtype, src, dst) takes two layouts; got "
                        f"{2 + len(rest)} after the dtype")
    warnings.warn("plan_layouts(shape, dtype, spl, ssbp, dpl, dsbp) is deprecated: pass two "
                  "layouts, plan_layouts(shape, dtype, sf.Layout(spl, ssbp), sf.Layout(dpl, "
                  "dsbp))", DeprecationWarning, stacklevel=3)
    return (spl, ssbp), tuple(rest)


@memoize(4096)
def _plan_layouts(shape: tuple, dtype: torch.dtype, src: Layout, dst: Layout) -> BoxingPlan:
    (spl, ssbp), (dpl, dsbp) = src, dst
    itemsize = torch.empty((), dtype=dtype).element_size()
    candidates: list[tuple] = []
    if spl == dpl:
        path = _shortest_path(shape, itemsize, spl, ssbp, dsbp)
        if path is not None:
            candidates.append(path)
    src, dst = Layout(spl, ssbp), Layout(dpl, dsbp)
    if src != dst:
        candidates.extend(_via_transfer(shape, itemsize, src, dst))
    if not candidates:
        raise BoxingError(f"no boxing from {src} to {dst} for shape {shape}")
    best = min(candidates, key=_path_cost)
    return BoxingPlan(shape, dtype, src, dst, tuple(best))


def _path_cost(steps: Sequence[BoxingStep]) -> tuple[int, int, int]:
    return (sum(s.nbytes for s in steps), int(any(s.kind == "transfer" for s in steps)), len(steps))


# -- same placement: shortest path over nd-sbp states -------------------------------------------
def _sbp_choices(ndim: int, ssbp: tuple, dsbp: tuple) -> tuple[list[int], list[str]]:
    """Tensor axes and partial ops that intermediate states may use."""
    used = sorted({s.axis for s in ssbp + dsbp if isinstance(s, Split)})
    axes = list(range(ndim)) if ndim <= 3 else used or [0]
    ops = sorted({"sum"} | {s.op for s in ssbp + dsbp if isinstance(s, Partial)})
    return axes, ops


def _neighbours(state: tuple, axes: list[int], ops: list[str]):
    """(new_state, dims) for every single step out of ``state`` (validity not yet checked)."""
    k = len(state)
    for r in range(1, k + 1):
        for dims in itertools.combinations(range(k), r):
            sub = [state[d] for d in dims]

            def put(values, dims=dims):
                new = list(state)
                for d, v in zip(dims, values):
                    new[d] = v
                return tuple(new)

            if all(isinstance(s, Partial) for s in sub) and len({s.op for s in sub}) == 1:
                yield put([B] * r), dims
                for combo in itertools.product(axes, repeat=r):
                    yield put([Split(a) for a in combo]), dims
            if all(isinstance(s, Split) for s in sub):
                yield put([B] * r), dims
                for combo in itertools.product(axes, repeat=r):
                    if all(a != s.axis for a, s in zip(combo, sub)):
                        yield put([Split(a) for a in combo]), dims
            if r == 1:
                s = sub[0]
                if isinstance(s, Broadcast):
                    for a in axes:
                        yield put([Split(a)]), dims
                if isinstance(s, (Broadcast, Split)):
                    for op in ops:
                        yield put([Partial(op)]), dims


@memoize(1 << 14)
def _edges(shape: tuple, itemsize: int, pl: Placement, state: tuple, axes: tuple,
           ops: tuple) -> tuple:
    """The valid single steps out of ``state``: ``((new_state, step), ...)``."""
    out: dict[tuple, BoxingStep] = {}
    for new, dims in _neighbours(state, axes, ops):
        if new == state or not is_valid_move(state, new, dims):
            continue
        step = make_step(shape, pl, state, new, dims, itemsize)
        old = out.get(new)
        if old is None or (step.nbytes, len(step.dims)) < (old.nbytes, len(old.dims)):
            out[new] = step
    return tuple(out.items())


def _shortest_path(shape: tuple, itemsize: int, pl: Placement, ssbp: tuple,
                   dsbp: tuple) -> list[BoxingStep] | None:
    if ssbp == dsbp:
        return []
    axes, ops = _sbp_choices(len(shape), ssbp, dsbp)
    axes, ops = tuple(axes), tuple(ops)
    tie = itertools.count()
    best = {ssbp: (0, 0)}
    heap = [((0, 0), next(tie), ssbp, [])]
    while heap:
        cost, _, state, path = heapq.heappop(heap)
        if state == dsbp:
            return path
        if best.get(state, cost) < cost:
            continue
        for new, step in _edges(shape, itemsize, pl, state, axes, ops):
            ncost = (cost[0] + step.nbytes, cost[1] + 1)
            if ncost < best.get(new, (float("inf"), 0)):
                best[new] = ncost
                heapq.heappush(heap, (ncost, next(tie), new, path + [step]))
    return None


# -- any placements: reduce partial sources, then point to point ---------------------------------
def _reduced_sources(ndim: int, ssbp: tuple, dsbp: tuple) -> list[tuple]:
    """Partial-free layouts a partial source may be reduced to before a transfer."""
    choices = []
    wanted = [s for s in dsbp if isinstance(s, Split)]
    for s in ssbp:
        if isinstance(s, Partial):
            opts = [B] + [Split(a) for a in range(ndim)]
            choices.append(sorted(set(opts) | set(wanted), key=repr))
        else:
            choices.append([s])
    return [tuple(c) for c in itertools.product(*choices)]


def _via_transfer(shape: tuple, itemsize: int, src: Layout,
                  dst: Layout) -> list[list[BoxingStep]]:
    spl, ssbp = src
    out = []
    for mid in _reduced_sources(len(shape), ssbp, dst.sbp):
        pre = _shortest_path(shape, itemsize, spl, ssbp, mid) if mid != ssbp else []
        if pre is None:
            continue
        if (spl, mid) == dst:
            out.append(pre)
            continue
        out.append(pre + [_transfer_step(shape, itemsize, Layout(spl, mid), dst)])
    return out


def _transfer_step(shape: tuple, itemsize: int, src: Layout, dst: Layout) -> BoxingStep:
    """Routes from a partial-free source: each destination region from one holder, preferring
    the destination rank itself, else the least-loaded holder."""
    (spl, ssbp), (dpl, dsbp) = src, dst
    holders: dict[tuple, list[int]] = {}
    for r, box in member_boxes(shape, spl, ssbp).items():
        holders.setdefault(box, []).append(r)
    load = {r: 0 for r in spl}
    routes = []
    dboxes = member_boxes(shape, dpl, dsbp)
    for c in dpl.coords():
        r = dpl.rank_at(c)
        if not holds_value(dsbp, c):
            continue  # it holds zeros
        need = dboxes[r]
        for box, owners in holders.items():
            inter = intersect(box, need)
            if box_numel(inter) == 0 and box_numel(need) > 0:
                continue
            if box_numel(need) == 0:
                continue
            src = r if r in owners else min(owners, key=lambda o: (load[o], owners.index(o)))
            if src != r:
                load[src] += box_numel(inter)
            routes.append((src, r, inter))
    step = BoxingStep("transfer", shape, spl, ssbp, dpl, dsbp, (), "sum", tuple(routes), itemsize)
    return _with_bytes(step)
