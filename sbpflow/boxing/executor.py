"""Run boxing steps on this rank's local shard; each step is an autograd Function whose
backward runs the dual step (docs/design.md, gradients)."""

from __future__ import annotations

from typing import Callable

import torch

from ..caches import BoundedDict
from ..comm import Communicator
from ..sbp import Partial, Split, holds_value, shard_box
from .boxes import box_numel, box_shape, contains, intersect, relative, tiles
from .steps import Step, dual_step, member_boxes

__all__ = ["run_step", "apply_step", "identity_value", "empty_local"]


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
def _local(step: Step, x: torch.Tensor, comm: Communicator, coord: tuple) -> torch.Tensor:
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


def _group_boxes(step: Step, coord: tuple):
    pl = step.src_placement
    group = pl.group(step.dims, coord)
    src = member_boxes(step.shape, pl, step.src_sbp)
    dst = member_boxes(step.shape, pl, step.dst_sbp)
    return group, src, dst


def _all_gather(step: Step, x: torch.Tensor, comm: Communicator, coord: tuple) -> torch.Tensor:
    group, src, dst = _group_boxes(step, coord)
    mine = dst[comm.rank]

    def assemble(pieces):
        out = torch.empty(box_shape(mine), dtype=x.dtype, device=x.device)
        for r, piece in zip(group, pieces):
            out[relative(src[r], mine)] = piece
        return out

    return comm.all_gather(x.contiguous(), group, [box_shape(src[r]) for r in group], assemble)


def _all_to_all(step: Step, x: torch.Tensor, comm: Communicator, coord: tuple) -> torch.Tensor:
    group, src, dst = _group_boxes(step, coord)
    me_src, me_dst = src[comm.rank], dst[comm.rank]
    pieces = [x[relative(intersect(me_src, dst[r]), me_src)].contiguous() for r in group]
    incoming = [intersect(src[r], me_dst) for r in group]

    def assemble(received):
        out = torch.empty(box_shape(me_dst), dtype=x.dtype, device=x.device)
        for box, piece in zip(incoming, received):
            out[relative(box, me_dst)] = piece
        return out

    return comm.all_to_all(pieces, group, [box_shape(b) for b in incoming], assemble)


def _reduce_scatter(step: Step, x: torch.Tensor, comm: Communicator, coord: tuple) -> torch.Tensor:
    group, src, dst = _group_boxes(step, coord)
    me_src = src[comm.rank]
    pieces = [x[relative(dst[r], me_src)].contiguous() for r in group]
    return comm.reduce_scatter(pieces, group, step.op)


def _all_reduce(step: Step, x: torch.Tensor, comm: Communicator, coord: tuple) -> torch.Tensor:
    group = step.src_placement.group(step.dims, coord)
    return comm.all_reduce(x.contiguous(), group, step.op)


_KINDS: dict[str, Callable] = {
    "local": _local, "all_gather": _all_gather, "all_to_all": _all_to_all,
    "reduce_scatter": _reduce_scatter, "all_reduce": _all_reduce,
}


def _transfer(step: Step, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    me = comm.rank
    spl, dpl = step.src_placement, step.dst_placement
    in_dst = me in dpl
    device = comm.device(dpl.device_type) if in_dst else x.device
    sbox = member_boxes(step.shape, spl, step.src_sbp).get(me)
    sends, recvs, local = [], [], []
    for s, d, box in step.routes:
        if s == me:
            piece = x[relative(box, sbox)]
            if d == me:
                local.append((box, piece))
            else:
                sends.append((d, piece.contiguous()))
        elif d == me:
            recvs.append((s, box_shape(box), x.dtype, device))
    received = iter(comm.exchange(sends, recvs)) if sends or recvs else iter(())
    if not in_dst:
        return empty_local(x.dtype, x.device)
    dbox = member_boxes(step.shape, dpl, step.dst_sbp)[me]
    if _routes_tile(step, me, dbox):
        # forward routes cover each element once: the pieces are copied in, nothing is filled
        out = torch.empty(box_shape(dbox), dtype=x.dtype, device=device)
        for box, piece in local:
            out[relative(box, dbox)] = piece
        for s, d, box in step.routes:
            if d == me and s != me:
                out[relative(box, dbox)] = next(received)
        return out
    # the dual's routes may overlap (they accumulate) or leave parts uncovered (identity)
    out = torch.zeros(box_shape(dbox), dtype=x.dtype, device=device)
    for box, piece in local:
        out[relative(box, dbox)] += piece.to(device)
    for s, d, box in step.routes:
        if d == me and s != me:
            out[relative(box, dbox)] += next(received)
    return out


# (id(step), rank) -> (step, whether the routes into the rank tile its box); the entry holds
# the step, so its id is not reused while the entry lives
_TILES = BoundedDict("boxing.routes_tile", 1 << 14)


def _routes_tile(step: Step, me: int, dbox: tuple) -> bool:
    entry = _TILES.get((id(step), me))
    if entry is not None and entry[0] is step:
        return entry[1]
    boxes = [box for _, d, box in step.routes if d == me and box_numel(box) > 0]
    result = tiles(boxes, dbox)
    _TILES.put((id(step), me), (step, result))
    return result


def run_step(step: Step, x: torch.Tensor, comm: Communicator,
             phase: str = "forward") -> torch.Tensor:
    """This rank's local shard after ``step`` (ranks outside the step pass ``x`` through)."""
    trace = comm.state.get("boxing_trace")
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
    def forward(ctx, x: torch.Tensor, step: Step, comm: Communicator) -> torch.Tensor:
        ctx.step, ctx.comm = step, comm
        out = run_step(step, x, comm)
        return out.view_as(out) if out is x else out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return run_step(dual_step(ctx.step), grad.contiguous(), ctx.comm, "backward"), None, None


def apply_step(step: Step, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """``run_step`` recorded by autograd when ``x`` requires grad and the step has a gradient
    (steps into or out of ``P(max)``/``P(min)`` are forward-only: their output is detached)."""
    if x.requires_grad and step.differentiable and torch.is_grad_enabled():
        return _StepFunction.apply(x, step, comm)
    with torch.no_grad():
        return run_step(step, x, comm)
