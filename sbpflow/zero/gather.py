"""The eager gather of a ZeRO unit (docs/zero.md, 'Overlap'): `UnitGather` boxes a unit's
stored shards to their compute layout with one coalesced all-gather per group and dtype, and
its backward reduce-scatters the gradients (the dual boxing, coalesced). Both run on the rank's
ZeRO worker (`sbpflow.zero.worker`), so they overlap compute:

* forward: while a unit runs, the gather of the unit that followed it in the previous forward is
  already started (prefetch; never a unit still running: the next step's first unit waits for
  the optimizer); gathers started for units that are not called before the outermost unit
  ends are dropped;
* backward: the reduce-scatter is started and backward goes on; at the end of the backward
  pass (an autograd callback) the shards are added to the parameters' ``.grad``.
"""

from __future__ import annotations

import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .. import comm as _comm
from ..param_state import mark_filled
from ..sbp import local_shape
from .layout import all_gather_into, geometry, reduce_scatter
from .worker import submit

__all__ = ["UnitCall", "UnitGather", "gather", "start", "done", "refill", "begin_call",
           "end_call"]


class UnitCall:
    """One eager call of a unit: ``items`` ((parameter, compute layout) pairs), ``future``
    (its gather, started), the ``flats`` the gather made (one buffer per group and dtype),
    ``prev`` (the call before it in this forward, weakly), ``tokens`` (saved views stage 3
    replaced) and ``regathered`` (stage 3's backward gather: a future, then dropped once the
    unit's reduce-scatter started)."""

    __slots__ = ("items", "future", "flats", "prev", "tokens", "regathered", "__weakref__")

    def __init__(self, items: list, future) -> None:
        self.items, self.future, self.flats = items, future, []
        self.prev, self.tokens, self.regathered = None, 0, None


def gather(items: list) -> tuple[list, list]:
    """The compute-layout locals of ``items`` ((parameter, compute layout)) and the flat
    buffers they are views of: one coalesced all-gather per group and dtype (no autograd)."""
    rank = _comm.rank()
    outs: list = [None] * len(items)
    flats: dict = {}
    todo = []
    for i, (p, nd) in enumerate(items):
        geo = geometry(tuple(p.shape), p.placement, nd, p.sbp, rank)
        if geo is None:
            outs[i] = p.local.detach()
            continue
        shape = local_shape(tuple(p.shape), p.placement.shape, nd, p.placement.coord_of(rank))
        flats.setdefault((geo.group, p.dtype, p.local.device), []).append((i, geo, shape))
    buffers = []
    with torch.no_grad():
        for (_, dtype, device), members in flats.items():
            sizes = [_numel(shape) for _, _, shape in members]
            flat = torch.empty(sum(sizes), dtype=dtype, device=device)
            buffers.append(flat)
            offset = 0
            for (i, geo, shape), n in zip(members, sizes):
                full = flat[offset:offset + n].view(shape)
                offset += n
                full.narrow(geo.axis, *geo.parts[geo.index]).copy_(items[i][0].local)
                outs[i] = full
                todo.append((full, geo))
        all_gather_into(todo)
    return outs, buffers


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def start(items: list):
    """`gather` of ``items`` started on the worker (a future)."""
    return submit(gather, items)


def done(result):
    """A future already holding ``result``."""
    fut = Future()
    fut.set_result(result)
    return fut


def refill(wholes: list) -> None:
    """Gather stage 2's whole copies again after their shards were written (`take_stale`):
    ``wholes`` are (whole local, parameter, compute layout) triples; waits for the
    all-gather."""
    todo = []
    for whole, p, compute in wholes:
        geo = geometry(tuple(p.shape), p.placement, compute, tuple(p.sbp), _comm.rank())
        if geo is not None:
            todo.append((whole, geo))
    if todo:
        submit(all_gather_into, todo).result()
    for _, p, _ in wholes:
        mark_filled(p)


# -- prefetch ------------------------------------------------------------------------------------
class _Prefetch(NamedTuple):
    items: list
    future: object


@dataclass(slots=True)
class _UnitCalls:
    """One rank's unit calls (`begin_call` / `end_call`; `Communicator.per_rank.zero_units`)."""

    active: list = field(default_factory=list)  # the units whose forward runs, innermost last
    next: dict = field(default_factory=dict)  # id(unit) -> weakref: the unit called after it
    last: weakref.ref | None = None  # the unit called last
    pending: dict = field(default_factory=dict)  # id(unit) -> its `_Prefetch`, started
    call: weakref.ref | None = None  # this outermost forward's latest `UnitCall`


def _state() -> _UnitCalls:
    st = _comm.current().per_rank
    s = st.zero_units
    if s is None:
        s = st.zero_units = _UnitCalls()
    return s


def begin_call(module, items: list, items_of) -> UnitCall | None:
    """A unit call of ``module`` on ``items`` as its forward starts: its gather (prefetched, or
    started now), and the next unit's started (``items_of(module)`` gives a unit's items).
    Without items (a model whose own parameters are not sharded) it only marks the call."""
    s = _state()
    if not s.active:
        s.call = None        # a new outermost forward
    last = s.last() if s.last is not None else None
    if last is not None and last is not module:
        s.next[id(last)] = weakref.ref(module)
    s.last = weakref.ref(module)
    if not items:
        s.active.append(module)
        return None
    hit = s.pending.pop(id(module), None)
    future = hit.future if hit is not None and hit.items == items else start(items)
    s.active.append(module)
    nxt = s.next.get(id(module))
    nxt = nxt() if nxt is not None else None
    if nxt is not None and all(m is not nxt for m in s.active) and \
            id(nxt) not in s.pending:
        nitems = items_of(nxt)
        if nitems:
            s.pending[id(nxt)] = _Prefetch(nitems, start(nitems))
    call = UnitCall(items, future)
    prev = s.call
    call.prev = prev
    s.call = weakref.ref(call)
    return call


def end_call(module) -> None:
    """``module``'s unit forward ended; the outermost one drops unused prefetches."""
    s = _state()
    if s.active and s.active[-1] is module:
        s.active.pop()
    if not s.active:
        s.pending.clear()


# -- the autograd function -----------------------------------------------------------------------
class UnitGather(torch.autograd.Function):
    """Forward: the call's gather (the unit's boxing ``stored -> compute``, coalesced);
    backward: the gradients reduce-scattered to the stored shards (its dual, coalesced),
    started on the worker and added to ``.grad`` at the end of the backward pass. A shard
    that does not require grad (a parameter frozen after ZeRO was applied, as torch and
    FSDP2 allow) gives a gathered copy that does not either, and no gradient."""

    @staticmethod
    def forward(ctx, call: UnitCall, *shards):
        ctx.call = call
        outs, call.flats = call.future.result()
        call.future = None
        frozen = [o for o, needs in zip(outs, ctx.needs_input_grad[1:]) if not needs]
        if frozen and len(frozen) < len(outs):   # (none requires grad: autograd records none)
            ctx.mark_non_differentiable(*frozen)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        call = ctx.call
        call.regathered = None       # stage 3's backward copies are no longer needed
        rank = _comm.rank()
        todo = []
        for (p, nd), g, needs in zip(call.items, grads, ctx.needs_input_grad[1:]):
            geo = geometry(tuple(p.shape), p.placement, nd, p.sbp, rank)
            if geo is not None and needs:
                todo.append((p, g.contiguous(), geo))
        pending = _comm.current().per_rank.zero_pending
        pending.append(([p for p, _, _ in todo], submit(_reduce, todo)))
        # (one callback per call: the first to run drains them all)
        torch.autograd.Variable._execution_engine.queue_callback(_drain)
        return (None,) * (1 + len(grads))


def _reduce(todo: list) -> list:
    with torch.no_grad():
        return [s.clone() for s in reduce_scatter([(g, geo) for _, g, geo in todo])]


def _drain() -> None:
    """At the end of a backward pass: wait for its reduce-scatters and add the shards to the
    parameters' gradients (as autograd would have)."""
    st = _comm.current().per_rank
    pending, st.zero_pending = st.zero_pending, []
    with torch.no_grad():
        for params, fut in pending:
            for p, shard in zip(params, fut.result()):
                local = p.local
                if local.grad is None:
                    local.grad = shard
                else:
                    local.grad.add_(shard)
