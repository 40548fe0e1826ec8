"""Gradients boxed to their parameters' update layouts, as the optimizer's step and
`clip_grad_norm_` read them: `boxed_grad` one at a time, `boxed_grads` coalesced (the
all-reduces of data parallelism bucketed as DDP's, ZeRO stage 1's reduce-scatters), with the
reductions started during backward taken as they are. A result kept (``remember``) is reused
while the gradient is unchanged, so clipping then stepping reduces each gradient once.
"""

from __future__ import annotations

import functools

import torch

from .. import comm as _comm
from ..gradsync import collect
from ..param_state import update_layout
from ..sbp import Partial
from ..tensor import GlobalTensor
from ..utils import IdentityMap
from ..zero import layout as _zero
from ..zero.shard_sync import collect as _collect_shards

__all__ = ["boxed_grad", "boxed_grads"]


def _boxed_cache() -> IdentityMap:
    """This rank's parameter -> (gradient local, its version, boxed gradient) remembered."""
    return _comm.current().per_rank.optim_boxed_grads


def boxed_grad(p: GlobalTensor, *, remember: bool = False) -> GlobalTensor | None:
    """``p.grad`` in ``p``'s update layout (its own, or the split one of ZeRO stage 1:
    `sbpflow.param_state.update_layout`; a collective unless the layouts agree). A result kept by
    ``remember=True`` (as `clip_grad_norm_` does) is reused while ``p``'s gradient is unchanged,
    so clipping then stepping reduces each gradient once."""
    g_local = p.local.grad
    if g_local is None:
        return None
    cache = _boxed_cache()
    hit = cache.get(p)
    if hit is not None:
        ref, version, boxed = hit
        if ref is g_local and g_local._version == version:
            return boxed
        cache.pop(p, None)
    cache.update(collect([p]))
    hit = cache.get(p)
    if hit is not None and hit[0] is g_local and g_local._version == hit[1]:
        return hit[2]
    with torch.no_grad():
        boxed = p.grad.to_global(p.placement, update_layout(p))
    if remember:
        cache[p] = (g_local, g_local._version, boxed)
    return boxed


_BUCKET_BYTES = 32 << 20  # gradients all-reduced together, at most this many bytes at once
# ZeRO-1 gradients reduce-scattered together during backward: small enough that the first
# buckets start while backward goes on
_SHARD_BUCKET = 4 << 20


def boxed_grads(params: list, *, remember: bool = False, consume: bool = False) -> list:
    """`boxed_grad` of every parameter (None where there is no gradient), with the gradients
    whose boxing is one all-reduce over the same ranks coalesced into few large all-reduces
    (bucketed as DDP does: the same bytes, far fewer messages), and those of ZeRO stage 1
    (reduce-scattered to their update layout) into few reduce-scatters. Every rank must call
    it with the same parameters in the same order. The results of reductions started during
    backward stay remembered (a second call sends nothing) unless ``consume`` (the optimizer's
    step, which forgets them right after)."""
    from ..boxing import plan_layouts
    comm = _comm.current()
    out: list = [None] * len(params)
    buckets: dict = {}
    sharded: list = []   # (index, geometry) of ZeRO stage-1 gradients
    cache = _boxed_cache()
    # all-reduces (gradsync) and ZeRO-1 reduce-scatters started during backward (a dict by
    # parameter), merged into the remembered results when those are kept
    started = collect(params)
    started.update(_collect_shards(params))
    used = 0
    if cache or remember or not consume:
        cache.update(started)
        started = cache
    for i, p in enumerate(params):
        g = p.local.grad
        if g is None:
            continue
        hit = started.get(p)
        if hit is not None and hit[0] is g and g._version == hit[1]:
            out[i] = hit[2]
            used += 1
            continue
        lay = update_layout(p)
        if lay != p.sbp:
            geo = _zero.geometry(tuple(p.shape), p.placement, p.sbp, lay, comm.rank)
            if geo is not None:
                sharded.append((i, geo))
            continue
        pl = p.placement
        # outside its placement: the empty shard, nothing to reduce; on a placement of one
        # device (a pipeline stage's): the local gradient is the value (a partial sum of one)
        if pl.size == 1 or comm.rank not in pl:
            out[i] = GlobalTensor(g, tuple(p.shape), pl, p.sbp)
            continue
        lay = p.global_layout
        plan = plan_layouts(tuple(p.shape), g.dtype, lay.dual(), lay)
        group = plan.all_reduce_group(comm.rank)
        if group is not None and len(group) == 1:
            out[i] = GlobalTensor(g, tuple(p.shape), pl, p.sbp)  # a group of one: a relabel
        elif group is not None:
            key = (group, plan.steps[0].op, g.dtype, g.device)
            buckets.setdefault(key, []).append(i)
        else:
            out[i] = boxed_grad(p, remember=remember)
    if started is not cache and len(started) > used:
        cache.update(started)   # results for parameters not asked for (or stale): kept
    _all_reduced(params, buckets, out, remember, comm)
    _reduce_scattered(params, sharded, out, remember)
    return out


def _all_reduced(params: list, buckets: dict, out: list, remember: bool, comm) -> None:
    """Fill ``out`` with the gradients of ``buckets`` ((group, op, dtype, device) -> indices),
    all-reduced in bounded coalesced buckets, in parameter order."""
    cache = _boxed_cache()
    for (group, op, _, _), idxs in buckets.items():
        start = 0
        while start < len(idxs):  # bounded buckets, in parameter order
            chunk, size = [], 0
            while start < len(idxs) and (not chunk or size < _BUCKET_BYTES):
                g = params[idxs[start]].local.grad
                chunk.append(idxs[start])
                size += g.numel() * g.element_size()
                start += 1
            flat = torch.cat([params[i].local.grad.reshape(-1) for i in chunk])
            reduced = comm.all_reduce_start(flat, group, op, inplace=True).wait()
            offset = 0
            for i in chunk:
                p = params[i]
                n = p.local.grad.numel()
                local = reduced[offset:offset + n].view_as(p.local.grad)
                offset += n
                out[i] = GlobalTensor(local, tuple(p.shape), p.placement, p.sbp)
                if remember:
                    cache[p] = (p.local.grad, p.local.grad._version, out[i])


def _reduce_scattered(params: list, sharded: list, out: list, remember: bool) -> None:
    """Fill ``out`` with the ZeRO stage-1 gradients ``sharded`` ((index, geometry)),
    reduce-scattered to their update layout in coalesced buckets."""
    if not sharded:
        return
    cache = _boxed_cache()
    with torch.no_grad():
        shards = _zero.reduce_scatter([(params[i].local.grad, geo) for i, geo in sharded])
    for (i, _), shard in zip(sharded, shards):
        p = params[i]
        out[i] = GlobalTensor(shard, tuple(p.shape), p.placement, update_layout(p))
        if remember:
            cache[p] = (p.local.grad, p.local.grad._version, out[i])


@functools.lru_cache(maxsize=256)
def _has_partial(nd_sbp: tuple) -> bool:
    return any(isinstance(s, Partial) for s in nd_sbp)


def _remember(p: GlobalTensor, boxed: GlobalTensor) -> None:
    """Record ``boxed`` as ``p``'s boxed gradient at the gradient's current version."""
    g_local = p.local.grad
    _boxed_cache()[p] = (g_local, g_local._version, boxed)


def _forget(p: GlobalTensor) -> None:
    cache = _boxed_cache()
    if cache:
        cache.pop(p, None)
