"""Run boxing steps on this rank's local shard; each step is an autograd Function whose
backward runs the dual step (docs/design.md, gradients)."""

from __future__ import annotations

from functools import partial
from typing import Callable, NamedTuple

import torch

from ..caches import BoundedDict
from ..comm import Communicator
from ..sbp import Partial, Split, holds_value, shard_box
from .boxes import (box_numel, box_shape, contains, intersect, joins, relative, stacked_axis,
                    tiles)
from .steps import BoxingStep, dual_step, member_boxes

__all__ = ["run_step", "apply_step", "identity_value", "empty_local", "whole_message"]


def identity_value(op: str, dtype: torch.dtype):
    """The value that leaves an ``op``-reduction unchanged (0 for sum, -inf/min for max, ...)."""
    if op == "sum":
        return 0
    if dtype == torch.bool:
        return op == "min"
    info = torch.finfo(dtype) if dtype.is_floating_point or dtype.is_complex else torch.iinfo(dtype)
    if dtype.is_floating_point:
        return float("-inf") if op == "max" else float("inf")
    return info.min if op == "max" else info.max


def empty_local(dtype: torch.dtype, device: torch.device, requires_grad: bool = False) -> torch.Tensor:
    """The shard of a rank outside a tensor's placement."""
    return torch.empty(0, dtype=dtype, device=device, requires_grad=requires_grad)


def _holder_and_op(dst: tuple, src: tuple, coord: tuple, dims) -> tuple[bool, str]:
    """Whether this rank keeps its data when ``dims`` turn partial, and the reduction whose
    identity surrounds a kept shard.

    A replicated (or absent) source dim turning partial follows `sbp.holds_value` (a rank
    that does not hold the value holds zeros); turning ``S`` into ``P`` every rank keeps its
    own shard, and the rest of its region is the reduction's identity.
    """
    turning = [d for d in dims if isinstance(dst[d], Partial) and src[d] != dst[d]]
    holder = holds_value(dst, coord, [d for d in turning if not isinstance(src[d], Split)])
    ops = [dst[d].op for d in turning if isinstance(src[d], Split)]
    return holder, ops[-1] if ops else "sum"


# -- one function per kind; each returns this rank's new local shard ------------------------
def _local(step: BoxingStep, x: torch.Tensor, comm: Communicator,
           coord: tuple) -> torch.Tensor:
    pl = step.src_placement
    sbox = shard_box(step.shape, pl.shape, step.src_sbp, coord)
    dbox = shard_box(step.shape, pl.shape, step.dst_sbp, coord)
    holder, op = _holder_and_op(step.dst_sbp, step.src_sbp, coord, step.dims)
    if not holder:
        return torch.zeros(box_shape(dbox), dtype=x.dtype, device=x.device)
    if contains(sbox, dbox):
        return x[relative(dbox, sbox)]  # a view, as torch's narrow / chunk give
    # S -> P: my shard goes into a region filled with the reduction's identity
    out = torch.full(box_shape(dbox), identity_value(op, x.dtype), dtype=x.dtype, device=x.device)
    inter = intersect(sbox, dbox)
    out[relative(inter, dbox)] = x[relative(inter, sbox)]
    return out


def _group_boxes(step: BoxingStep, coord: tuple):
    pl = step.src_placement
    group = pl.group(step.dims, coord)
    src = member_boxes(step.shape, pl, step.src_sbp)
    dst = member_boxes(step.shape, pl, step.dst_sbp)
    return group, src, dst


def _all_gather(step: BoxingStep, x: torch.Tensor, comm: Communicator,
                coord: tuple) -> torch.Tensor:
    group, src, dst = _group_boxes(step, coord)
    mine = dst[comm.rank]
    boxes = [src[r] for r in group]

    shape = _Shape.of(step, comm.rank, boxes, mine)
    # a batch split in group order: the pieces received back to back are the result
    joined = box_shape(mine) if shape.joined else None
    return comm.all_gather(x.contiguous(), group, [box_shape(b) for b in boxes],
                           partial(_assemble, shape, boxes, mine, x), joined=joined)


def _all_to_all(step: BoxingStep, x: torch.Tensor, comm: Communicator,
                coord: tuple) -> torch.Tensor:
    """The pieces go as views of ``x`` (the backend packs them for the wire in one copy)."""
    group, src, dst = _group_boxes(step, coord)
    me_src, me_dst = src[comm.rank], dst[comm.rank]
    pieces = [x[relative(intersect(me_src, dst[r]), me_src)] for r in group]
    incoming = [intersect(src[r], me_dst) for r in group]

    shape = _Shape.of(step, comm.rank, incoming, me_dst)
    joined = box_shape(me_dst) if shape.joined else None
    return comm.all_to_all(pieces, group, [box_shape(b) for b in incoming],
                           partial(_assemble, shape, incoming, me_dst, x), joined=joined)


def _assemble(shape: "_Shape", boxes: list, region, x: torch.Tensor,
              pieces: list) -> torch.Tensor:
    """The tensor of ``region`` from the received ``pieces`` of ``boxes`` (a new tensor of
    ``x``'s dtype and device): one ``torch.cat`` when they are slabs along one axis."""
    if shape.axis is not None:
        return torch.cat([p for p, b in zip(pieces, boxes) if box_numel(b)], shape.axis)
    out = torch.empty(box_shape(region), dtype=x.dtype, device=x.device)
    for box, piece in zip(boxes, pieces):
        out[relative(box, region)] = piece
    return out


class _Shape(NamedTuple):
    """How the pieces a rank receives in a step make its shard: ``joined``, back to back in
    group order (`boxes.joins`); ``axis``, as slabs along that axis (`boxes.stacked_axis`)."""

    joined: bool
    axis: int | None

    @staticmethod
    def of(step: BoxingStep, me: int, boxes: list, region) -> "_Shape":
        """Worked out once a (step, rank)."""
        entry = _SHAPES.get((id(step), me))
        if entry is not None and entry[0] is step:
            return entry[1]
        shape = _Shape(joins(boxes, region), stacked_axis(boxes, region))
        _SHAPES.put((id(step), me), (step, shape))
        return shape


# (id(step), rank) -> (step, its `_Shape` on the rank); the entry holds the step
_SHAPES = BoundedDict("boxing.received_shapes", 1 << 14)


def _reduce_scatter(step: BoxingStep, x: torch.Tensor, comm: Communicator,
                    coord: tuple) -> torch.Tensor:
    group, src, dst = _group_boxes(step, coord)
    me_src = src[comm.rank]
    pieces = [x[relative(dst[r], me_src)] for r in group]  # views: packed by the backend
    return comm.reduce_scatter(pieces, group, step.op)


def _all_reduce(step: BoxingStep, x: torch.Tensor, comm: Communicator,
                coord: tuple) -> torch.Tensor:
    group = step.src_placement.group(step.dims, coord)
    return comm.all_reduce(x.contiguous(), group, step.op)


_KINDS: dict[str, Callable] = {
    "local": _local, "all_gather": _all_gather, "all_to_all": _all_to_all,
    "reduce_scatter": _reduce_scatter, "all_reduce": _all_reduce,
}


class _Routes(NamedTuple):
    """A transfer step's routes as one rank runs them, worked out once a (step, rank):
    ``sends`` ``(dst, slices)`` and ``recvs`` ``(src, shape, slices)`` (``slices`` None: the
    whole shard, no view), ``local`` ``(dst slices, src slices)`` kept on this rank, ``dbox``
    its destination box (None: not in the destination), ``tile``: the routes into it cover
    it once (pieces are copied in, nothing filled), ``whole``: one received message is the
    whole destination shard (it is the result, no copy)."""

    sends: tuple
    recvs: tuple
    local: tuple
    dbox: tuple | None
    tile: bool
    whole: bool


def _routes_of(step: BoxingStep, me: int) -> _Routes:
    sbox = member_boxes(step.shape, step.src_placement, step.src_sbp).get(me)
    dbox = (member_boxes(step.shape, step.dst_placement, step.dst_sbp)[me]
            if me in step.dst_placement else None)

    def within(box, origin):  # None when ``box`` is all of ``origin``
        return None if box == origin else relative(box, origin)

    sends, recvs, local = [], [], []
    for s, d, box in step.routes:
        if s == me and d == me:
            local.append((relative(box, dbox), relative(box, sbox)))
        elif s == me:
            sends.append((d, within(box, sbox)))
        elif d == me:
            recvs.append((s, box_shape(box), within(box, dbox)))
    tile = dbox is not None and tiles([b for _, d, b in step.routes
                                       if d == me and box_numel(b) > 0], dbox)
    whole = tile and not local and len(recvs) == 1 and recvs[0][2] is None
    return _Routes(tuple(sends), tuple(recvs), tuple(local), dbox, tile, whole)


# (id(step), rank) -> (step, its `_Routes` on the rank); the entry holds the step, so its id
# is not reused while the entry lives
_ROUTES = BoundedDict("boxing.transfer_routes", 1 << 14)


def _routes(step: BoxingStep, me: int) -> _Routes:
    entry = _ROUTES.get((id(step), me))
    if entry is not None and entry[0] is step:
        return entry[1]
    routes = _routes_of(step, me)
    _ROUTES.put((id(step), me), (step, routes))
    return routes


def whole_message(step: BoxingStep, rank: int) -> tuple | None:
    """``rank``'s part of ``step`` when it is one message of a whole shard and nothing else:
    ``("send", dst)``, or ``("recv", src, shape)`` (``shape`` the received shard's, which is
    the rank's result); None for any other part or kind of step. A stage-to-stage activation
    and its gradient are such messages: `Communicator.send` / ``recv`` of the shard give what
    `run_step` gives, counted alike (one "p2p" call), without the general path's work."""
    if step.kind != "transfer":
        return None
    rt = _routes(step, rank)
    if rt.local or len(rt.sends) + len(rt.recvs) != 1:
        return None
    if rt.sends and rt.sends[0][1] is None and rt.dbox is None:
        return ("send", rt.sends[0][0])
    if rt.whole:
        return ("recv", rt.recvs[0][0], rt.recvs[0][1])
    return None


def _transfer(step: BoxingStep, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """This rank's part of a transfer between placements: its pieces sent, the others'
    received, in one batched exchange (a stage-to-stage activation: one message, sent and
    received whole)."""
    rt = _routes(step, comm.rank)
    device = comm.device(step.dst_placement.device_type) if rt.dbox is not None else x.device
    sends = [(d, (x if cut is None else x[cut]).contiguous()) for d, cut in rt.sends]
    recvs = [(s, shape, x.dtype, device) for s, shape, _ in rt.recvs]
    received = comm.exchange(sends, recvs) if sends or recvs else []
    if rt.dbox is None:
        return empty_local(x.dtype, x.device)
    if rt.whole:
        return received[0]
    if rt.tile:  # forward routes cover each element once: the pieces are copied in
        out = torch.empty(box_shape(rt.dbox), dtype=x.dtype, device=device)
        for dcut, scut in rt.local:
            out[dcut] = x[scut]
        for (_, _, cut), piece in zip(rt.recvs, received):
            out[cut if cut is not None else ...] = piece
        return out
    # the dual's routes may overlap (they accumulate) or leave parts uncovered (identity)
    out = torch.zeros(box_shape(rt.dbox), dtype=x.dtype, device=device)
    for dcut, scut in rt.local:
        out[dcut] += x[scut].to(device)
    for (_, _, cut), piece in zip(rt.recvs, received):
        out[cut if cut is not None else ...] += piece
    return out


def run_step(step: BoxingStep, x: torch.Tensor, comm: Communicator,
             phase: str = "forward") -> torch.Tensor:
    """This rank's local shard after ``step`` (ranks outside the step pass ``x`` through)."""
    trace = comm.per_rank.boxing_trace
    if trace is not None:
        trace.append((phase, step))
    if step.kind == "transfer":
        if comm.rank not in step.src_placement and comm.rank not in step.dst_placement:
            return x
        return _transfer(step, x, comm)
    pl = step.src_placement
    if comm.rank not in pl:
        return x
    return _KINDS[step.kind](step, x, comm, pl.coord_of(comm.rank))


class _StepFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, step: BoxingStep, comm: Communicator) -> torch.Tensor:
        ctx.step, ctx.comm = step, comm
        out = run_step(step, x, comm)
        return out.view_as(out) if out is x else out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return run_step(dual_step(ctx.step), grad.contiguous(), ctx.comm, "backward"), None, None


def apply_step(step: BoxingStep, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """``run_step`` recorded by autograd when ``x`` requires grad and the step has a gradient
    (steps into or out of ``P(max)``/``P(min)`` are forward-only: their output is detached)."""
    if x.requires_grad and step.differentiable and torch.is_grad_enabled():
        return _StepFunction.apply(x, step, comm)
    with torch.no_grad():
        return run_step(step, x, comm)
