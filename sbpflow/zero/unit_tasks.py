"""ZeRO units in a graph (docs/zero.md, 'Graph mode'): a graph's trace records each unit call
as a `UnitBegin` task (the unit's coalesced gather, `sbpflow.zero.gather.UnitGather`, and
its release hooks entered) and a `UnitEnd` task (the hooks left, the gathered buffers let go),
one pair per stage the unit's parameters are on. A replay runs them as eager runs a unit call:
stage 3 frees the gathered weights after the unit's forward and gathers them again for its
backward; the gradients are reduce-scattered in backward. The prefetch is planned: `link` gives
each begin task the next unit of its stage's forward, whose gather it starts before waiting
for its own. Collectives run on the ZeRO worker of the actor's stream (`zero_comm`).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, NamedTuple

import torch

from ..tensor import GlobalTensor, current_recorder
from .gather import UnitCall, UnitGather, done, gather, refill, start
from .pending import take_stale

__all__ = ["UnitBegin", "UnitEnd", "Recorded", "record_begin", "record_end", "link", "abandon"]


class _Forward(threading.local):
    """One thread's forward in progress: the begin tasks whose end has not run ((call,
    context) pairs), the last call (weakly: backward's prefetch chain) and the gather the last
    begin task started for the next (items, future)."""

    def __init__(self) -> None:
        self.open: list = []
        self.prev = None
        self.prefetch = None


_fwd = _Forward()


class UnitBegin(NamedTuple):
    """A unit's call starts (on one stage): gather ``items`` ((parameter, compute layout))
    from the shards in slots ``shards`` into slots ``outs`` (stage 2 with whole copies kept:
    views of ``wholes``), enter ``on_gather(call)``'s context. ``first``: the stage's first
    unit call of a forward (it resets the thread's state); ``next_items``: the gather to start
    for the next unit call (None: none)."""

    unit: str
    items: tuple
    wholes: tuple | None
    on_gather: Callable | None
    shards: tuple
    outs: tuple
    placement: Any
    mode: Any
    first: bool = False
    next_items: tuple | None = None

    keep = True   # a graph never drops it (its end task pairs with it)

    @property
    def name(self) -> str:
        return "zero_gather"

    @property
    def slots_read(self) -> tuple:
        return self.shards

    @property
    def slots_written(self) -> tuple:
        return self.outs

    def __repr__(self) -> str:
        outs = ", ".join(f"%{o}" for o in self.outs)
        kind = "whole copies" if self.wholes is not None else "one coalesced all-gather"
        return f"{outs} = zero_gather({self.unit or 'model'}: {len(self.items)} params, {kind})"

    def run(self, vals: list, env: Any) -> None:
        if self.first:
            abandon()   # what a failed run left
        items = list(self.items)
        if self.wholes is not None:
            stale = set(map(id, take_stale([p for p, _ in items])))
            refill([(w, p, nd) for w, (p, nd) in zip(self.wholes, items) if id(p) in stale])
            call = UnitCall(items, done(([w.view_as(w) for w in self.wholes], [])))
        else:
            pre, _fwd.prefetch = _fwd.prefetch, None
            call = UnitCall(items, pre[1] if pre is not None and pre[0] is self.items
                            else start(items))
        if self.next_items is not None:   # started before this unit's own gather is waited for
            _fwd.prefetch = (self.next_items, start(list(self.next_items)))
        call.prev = _fwd.prev
        _fwd.prev = weakref.ref(call)
        outs = UnitGather.apply(call, *[vals[s] for s in self.shards])
        for s, o in zip(self.outs, outs):
            vals[s] = o
        ctx = self.on_gather(call) if self.on_gather is not None else None
        if ctx is not None:
            ctx.__enter__()
        _fwd.open.append((call, ctx))


class UnitEnd(NamedTuple):
    """The unit call begun last on this thread ends: its context is left and its gathered
    buffers live on only where autograd saved them."""

    unit: str
    placement: Any
    mode: Any

    keep = True
    slots_read = ()
    slots_written = ()

    @property
    def name(self) -> str:
        return "zero_release"

    def __repr__(self) -> str:
        return f"zero_release({self.unit or 'model'})"

    def run(self, vals: list, env: Any) -> None:
        call, ctx = _fwd.open.pop()
        if ctx is not None:
            ctx.__exit__(None, None, None)
        call.flats = []


def abandon() -> None:
    """Leave the contexts of the unit calls begun on this thread and not ended (a forward that
    raised), innermost first, and forget its prefetch."""
    while _fwd.open:
        _, ctx = _fwd.open.pop()
        if ctx is not None:
            ctx.__exit__(None, None, None)
    _fwd.prev = _fwd.prefetch = None


def link(nodes: list) -> list:
    """``nodes`` (one stage's forward) with the unit calls chained: the first marked, each
    given the next one's items to prefetch (none when that one keeps whole copies)."""
    at = [i for i, n in enumerate(nodes) if isinstance(n, UnitBegin)]
    out = list(nodes)
    for k, i in enumerate(at):
        nxt = nodes[at[k + 1]] if k + 1 < len(at) else None
        out[i] = nodes[i]._replace(first=k == 0, next_items=None if nxt is None or
                                   nxt.wholes is not None else nxt.items)
    return out


# -- while a graph traces build --------------------------------------------------------------------
class Recorded(NamedTuple):
    """The unit calls `record_begin` recorded (one per stage): their unit and placements."""

    unit: str
    placements: tuple


def record_begin(unit: str, items: list, wholes: list | None,
                 on_gather: Callable | None) -> tuple[list, Recorded]:
    """Record the start of a call of ``unit`` (items: (parameter, compute layout)) in the
    graph being traced, one `UnitBegin` a stage; returns the gathered global tensors (in
    ``items`` order; computed now, as the trace runs the forward) and what `record_end`
    needs."""
    rec = current_recorder()
    groups: dict = {}
    for i, (p, _) in enumerate(items):
        groups.setdefault(frozenset(p.placement.flat_ranks), []).append(i)
    out: list = [None] * len(items)
    placements = []
    for idx in groups.values():
        sub = tuple(items[i] for i in idx)
        sub_wholes = tuple(wholes[i] for i in idx) if wholes is not None else None
        with torch.no_grad():
            locs = list(sub_wholes) if sub_wholes is not None else gather(list(sub))[0]
        gts = [GlobalTensor(loc.detach().requires_grad_(p.local.requires_grad), tuple(p.shape),
                            p.placement, nd) for loc, (p, nd) in zip(locs, sub)]
        pl = sub[0][0].placement
        rec.task(lambda r, o, mode, sub=sub, w=sub_wholes, pl=pl:
                 UnitBegin(unit, sub, w, on_gather, r, o, pl, mode),
                 [p for p, _ in sub], gts, pl)
        placements.append(pl)
        for i, g in zip(idx, gts):
            out[i] = g
    return out, Recorded(unit, tuple(placements))


def record_end(recorded: Recorded) -> None:
    """Record the end of the unit call `record_begin` recorded (last stage first: the calls
    nest on each stage's thread alike)."""
    rec = current_recorder()
    for pl in reversed(recorded.placements):
        rec.task(lambda r, o, mode, pl=pl: UnitEnd(recorded.unit, pl, mode), [], [], pl)

