"""ZeRO as layouts (docs/zero.md): along the mesh dims where a parameter is ``B`` (its
data-parallel dims), its optimizer state (stage 1), gradient (stage 2) and the parameter itself
(stage 3) are stored split (`stored_layout`) and boxed to the compute layout where they are used.

* `stored_layout` / `geometry`: the split layout and where each member's shard sits inside the
  compute-layout shard (a sub-box, so updates are in place and gathers are plain all-gathers).
* `reduce_scatter` / `all_gather_into`: the collectives, coalesced over parameters (one per
  bucket of parameters that share a group): stage 1's in the optimizer step, stages 2 and 3's
  around a module's forward (`sbpflow.zero.units`).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from .. import comm as _comm
from ..caches import memoize
from ..errors import SbpError
from ..placement import Placement
from ..sbp import Broadcast, Split, format_nd_sbp, shard_box
from ..tensor import GlobalTensor

__all__ = ["stored_layout", "Geometry", "geometry", "reduce_scatter", "all_gather_into",
           "chunks", "shard_view", "check_stage", "check_min_size", "STAGES"]

STAGES = (0, 1, 2, 3)
_BUCKET_BYTES = 32 << 20   # a coalesced collective moves at most about this much at once


def stored_layout(shape, nd_sbp: tuple, placement: Placement) -> tuple | None:
    """The layout ZeRO stores a parameter of logical ``shape`` and compute layout ``nd_sbp``
    in: ``S(a)`` on each data-parallel dim (``B``, more than one rank), the rest unchanged.
    ``a`` is the first axis no later non-data-parallel dim splits (such a split would cut
    inside the data-parallel part, and the stored shard would not lie inside the compute
    shard). None when there is no data-parallel dim or no such axis (0-d tensors, a 1-d bias
    split by a later tensor-parallel dim)."""
    nd = tuple(nd_sbp)
    dims = [d for d, s in enumerate(nd) if isinstance(s, Broadcast) and placement.shape[d] > 1]
    if not dims or not shape:
        return None
    later = [s.axis for e, s in enumerate(nd) if e > dims[0] and e not in dims and
             isinstance(s, Split)]
    for a in range(len(shape)):
        if a not in later:
            return tuple(Split(a) if d in dims else s for d, s in enumerate(nd))
    return None


class Geometry(NamedTuple):
    """Where the stored shards of one data-parallel group sit in the compute-layout shard they
    share: ``group`` (ranks, row-major over the data-parallel dims), ``index`` (this rank's
    position), ``axis`` and ``parts`` ((start, size) along ``axis`` per member)."""

    group: tuple
    index: int
    axis: int
    parts: tuple


@memoize(1 << 12)
def geometry(shape: tuple, placement: Placement, compute: tuple, stored: tuple,
             rank: int) -> Geometry | None:
    """The `Geometry` of a tensor of ``shape`` between ``compute`` and ``stored`` (a
    `stored_layout`) on ``rank``; None outside the placement."""
    if rank not in placement:
        return None
    coord = placement.coord_of(rank)
    dims = tuple(d for d, (c, s) in enumerate(zip(compute, stored)) if c != s)
    axis = stored[dims[0]].axis
    group = placement.group(dims, coord)
    base = shard_box(shape, placement.shape, compute, coord)
    parts = []
    for r in group:
        box = shard_box(shape, placement.shape, stored, placement.coord_of(r))
        if any(box[a] != base[a] for a in range(len(shape)) if a != axis):
            raise SbpError(f"ZeRO: the shard of {format_nd_sbp(stored)} on rank {r} does not lie "
                           f"inside the {format_nd_sbp(compute)} shard (tensor of shape {shape} "
                           f"on {placement}); use sf.parallel.zero.stored_layout")
        parts.append((box[axis][0] - base[axis][0], box[axis][1]))
    return Geometry(group, group.index(rank), axis, tuple(parts))


def _geometry_of(p: GlobalTensor, compute: tuple, stored: tuple) -> Geometry | None:
    return geometry(tuple(p.shape), p.placement, tuple(compute), tuple(stored), _comm.rank())


def shard_view(p: GlobalTensor, stored: tuple) -> GlobalTensor:
    """``p`` (in its own layout) seen in ``stored``: this rank's stored shard as a view of
    ``p``'s shard (writing it writes ``p``), no communication."""
    geo = _geometry_of(p, p.sbp, stored)
    local = p.local.detach()
    if geo is not None:
        local = local.narrow(geo.axis, *geo.parts[geo.index])
    return GlobalTensor(local, tuple(p.shape), p.placement, tuple(stored))


def _buckets(items: list, local_of: Callable) -> list:
    """Indices of ``items`` (pairs ending in a `Geometry`) grouped by (group, dtype, device)
    and cut into buckets of about `_BUCKET_BYTES`, in order: one coalesced collective each."""
    by_key: dict = {}
    for i, item in enumerate(items):
        t = local_of(item)
        by_key.setdefault((item[-1].group, t.dtype, t.device), []).append(i)
    out = []
    for (group, _, _), idxs in by_key.items():
        chunk, size = [], 0
        for i in idxs:
            t = local_of(items[i])
            chunk.append(i)
            size += t.numel() * t.element_size()
            if size >= _BUCKET_BYTES:
                out.append((group, chunk))
                chunk, size = [], 0
        if chunk:
            out.append((group, chunk))
    return out


def chunks(items: list, nbytes: int) -> list:
    """``items`` (tuples whose second-last entry is a local tensor) cut in order into lists of
    at most about ``nbytes``."""
    out, chunk, size = [], [], 0
    for it in items:
        t = it[-2]
        chunk.append(it)
        size += t.numel() * t.element_size()
        if size >= nbytes:
            out.append(chunk)
            chunk, size = [], 0
    if chunk:
        out.append(chunk)
    return out


def reduce_scatter(items: list) -> list:
    """``items``: (local gradient in the compute layout, partial along the group, `Geometry`).
    Returns each one's reduced stored shard (summed over the group), one reduce-scatter per
    bucket of parameters sharing a group. Every member calls it with the same parameters."""
    comm = _comm.current()
    out: list = [None] * len(items)
    for group, idxs in _buckets(items, lambda it: it[0]):
        pieces = [torch.cat([items[i][0].narrow(items[i][1].axis, *items[i][1].parts[j])
                             .reshape(-1) for i in idxs]) for j in range(len(group))]
        mine = comm.reduce_scatter(pieces, group)
        offset = 0
        for i in idxs:
            g, geo = items[i]
            shape = list(g.shape)
            shape[geo.axis] = geo.parts[geo.index][1]
            n = 1
            for s in shape:
                n *= s
            out[i] = mine[offset:offset + n].view(shape)
            offset += n
    return out


def all_gather_into(items: list) -> None:
    """``items``: (local tensor in the compute layout whose own stored part is current,
    `Geometry`). Fills every other member's part from that member, one all-gather per bucket."""
    comm = _comm.current()
    for group, idxs in _buckets(items, lambda it: it[0]):
        me = items[idxs[0]][1].index
        regions = [[items[i][0].narrow(items[i][1].axis, *items[i][1].parts[j]) for i in idxs]
                   for j in range(len(group))]
        mine = torch.cat([r.reshape(-1) for r in regions[me]])
        shapes = [(sum(r.numel() for r in regions[j]),) for j in range(len(group))]

        def assemble(pieces, regions=regions, me=me):
            for j, piece in enumerate(pieces):
                if j == me:
                    continue
                offset = 0
                for r in regions[j]:
                    n = r.numel()
                    r.copy_(piece[offset:offset + n].view(r.shape))
                    offset += n
        with torch.no_grad():
            comm.all_gather(mine, group, shapes=shapes, assemble=assemble)


def check_stage(stage, who: str) -> int:
    """``stage`` as an int of `STAGES`, else `SbpError` naming ``who``."""
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in STAGES:
        raise SbpError(f"{who}: zero must be one of {STAGES} (ZeRO stage; 0: off), got "
                       f"{stage!r}")
    return int(stage)


def check_min_size(min_size, who: str) -> int:
    """``min_size`` (ZeRO's threshold: parameters with fewer elements stay as their layout
    says) as an int >= 0, else `SbpError` naming ``who``'s argument."""
    if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 0:
        raise SbpError(f"{who}: the ZeRO size threshold (zero_min_size / min_size) must be an "
                       f"int >= 0 (a count of elements; 0 shards every parameter), got "
                       f"{min_size!r}")
    return int(min_size)
