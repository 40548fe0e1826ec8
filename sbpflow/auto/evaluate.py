"""Cost of a strategy: alpha-beta time of every redistribution, weight-gradient sync, compute,
and memory per device.

Redistribution is priced analytically, mesh dim by mesh dim, in a fixed order of collectives
(running the boxing planner on placements of 1024 ranks would be far too slow for a search);
moves the fixed order cannot make (nested splits) are priced as the planner's reduce-then-
transfer. See docs/auto.md, 'Evaluation' (the table, the order, and how the price compares
with the planner's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from ..caches import BoundedDict, memoize
from ..cost.formulas import linear_time, volume
from ..sbp import Broadcast, Partial, S, Split, dual_nd
from .space import _clip_axis
from .transfer_loads import find_fractions, transfer_fraction
from .walk import (TRANSFER_MAX_RANKS, TransferWalk, Walk, WalkMove, divisor, fine_walk,
                   layout_code)

__all__ = ["Breakdown", "Evaluator", "evaluate", "redistribution", "redistribution_steps",
           "redistribution_floor", "edge_lower_bounds"]


# ---- analytic redistribution -------------------------------------------------------------------
@memoize(1 << 16)
def _refine(mesh_a: tuple, mesh_b: tuple):
    """Common row-major refinement: (fine mesh, fine->coarse index for a, for b) or None."""
    if math.prod(mesh_a) == 1 and math.prod(mesh_b) == 1:   # one device: nothing to refine
        return (1,), (0,), (0,)
    def cuts(m):
        out, c = [], 1
        for f in reversed(m):
            c *= f
            out.append(c)
        return out  # cumulative products from the innermost dim
    ca, cb = cuts(mesh_a), cuts(mesh_b)
    allc = sorted(set(ca) | set(cb))
    for x, y in zip(allc, allc[1:]):
        if y % x:
            return None
    inner, prev = [], 1
    for c in allc:
        inner.append(c // prev)
        prev = c
    fine = tuple(reversed(inner))  # outermost first

    def owner(m):
        # fine dim j belongs to coarse dim i when prod(m[i+1:]) < prod(fine[j:]) <= prod(m[i:])
        out = []
        for j in range(len(fine)):
            c = math.prod(fine[j:])
            out.append(next(i for i in range(len(m)) if math.prod(m[i + 1:]) < c <= math.prod(m[i:])))
        return tuple(out)
    return fine, owner(mesh_a), owner(mesh_b)


def _split_factors(fine, nd, skip=()):
    f = {}
    for j, (s, m) in enumerate(zip(nd, fine)):
        if j not in skip and isinstance(s, Split):
            f[s.axis] = f.get(s.axis, 1) * m
    return f


def _piece(numel, fine, nd, skip):
    return numel / math.prod(_split_factors(fine, nd, skip).values() or [1])


@memoize(1 << 20)
def redistribution_steps(shape: tuple, src_mesh: tuple, src: tuple, dst_mesh: tuple,
                         dst: tuple) -> tuple:
    """The collectives of the analytic redistribution: `Collective` records ``(kind,
    fine_mesh, dims, numel)`` where ``numel`` is the size of the piece each collective is about
    (for a ``"transfer"``: the elements the busiest rank receives)."""
    return tuple(Collective(*m[:4]) for m in _plan(tuple(shape), tuple(src_mesh), tuple(src),
                                                   tuple(dst_mesh), tuple(dst))
                 if m.kind != "local")


def _local_shape(shape, fine, nd):
    """The (fractional) local shape of a rank under ``nd`` on ``fine`` (even splits)."""
    out = list(shape)
    for s, m in zip(nd, fine):
        if isinstance(s, Split):
            out[s.axis] /= m
    return out


def _strided(local, axis) -> bool:
    """Pieces cut along ``axis`` of a local tensor of shape ``local`` are not contiguous."""
    return math.prod(local[:axis]) > 1 + 1e-9


def _transfer(shape: tuple, fine: tuple, src: tuple, dst: tuple):
    """What the receivers get when a partial-free ``src`` layout is sent point to point into
    ``dst`` (the boxing planner's transfer step): a rank receives the part of its destination
    box it does not hold, one message from each rank whose source box overlaps it (one holder
    per distinct source region); a non-first rank of a ``P(sum)`` destination dim receives
    nothing (it holds zeros; a ``P(max)`` / ``P(min)`` one holds a copy, so it does receive).
    Returns ``(elements, loads)``: the most elements a rank receives, and the ``(elements,
    messages)`` of every receiver not dominated by another (the busiest in time is one of them,
    whatever alpha and beta are). None on meshes of more than ``TRANSFER_MAX_RANKS`` ranks
    (too many boxes to enumerate in a search)."""
    t = transfer_fraction(fine, src, dst, len(shape))
    if t is None:
        return None
    n = math.prod(shape)
    return max((f for f, _ in t), default=0.0) * n, tuple((f * n, m) for f, m in t)


class Move(NamedTuple):
    """One move of the analytic redistribution, on the refined mesh ``mesh``."""

    kind: str          # a collective kind, "local", "transfer", or "nested" (no valid step)
    mesh: tuple        # the refined (fine) mesh
    dims: tuple        # the mesh dims it runs over
    numel: float       # elements of the piece it is about (transfer: the busiest receiver's)
    copy: float = 0.0  # elements a rank copies through strided views
    loads: tuple = ()  # transfer: the receivers' (elements, messages) front (`_transfer`)
    fallback: str = ""  # nested: the collective the fixed order would use, priced as last resort


class Collective(NamedTuple):
    """A collective of `redistribution_steps`: ``numel`` elements of the piece it is about."""

    kind: str
    mesh: tuple
    dims: tuple
    numel: float


# not memoised: the evaluator keeps every price (`Evaluator._redist`), so a plan is asked for
# again only by another evaluator (0.3 % of VGG-13's, 4.6 % of GPT-3 exhaustive's), and a
# memo of its 116k plans cost more than those; the skeletons are (1 << 20 entries: GPT-3's
# 128-device stages walk about 200k distinct ones, evicted before reuse at 1 << 18)
def _plan(shape: tuple, src_mesh: tuple, src: tuple, dst_mesh: tuple, dst: tuple) -> tuple:
    """The `Move` s of the redistribution: the fixed order, or, when one of its moves is not a
    valid boxing step (nested splits of one axis), what the planner does instead: partial dims
    reduced on the source devices, then each rank sent what it lacks (`_via_transfer`). The
    walk depends on the shape only through its size and which local shards are strided, so
    it is found once per number of axes (`_skeleton`) and sized here."""
    return _sized_walk(_skeleton(len(shape), tuple(src_mesh), tuple(src), tuple(dst_mesh),
                                 tuple(dst)), shape)


def _sized_walk(walk: Walk, shape: tuple) -> tuple:
    """The `Move` s of ``walk`` for a tensor of ``shape``."""
    if walk.how == "moves":
        return tuple(_sized(m, shape) for m in walk.body)
    return _via_transfer(shape, walk.body)


@memoize(1 << 20)
def _skeleton(ndim: int, src_mesh: tuple, src: tuple, dst_mesh: tuple, dst: tuple) -> Walk:
    """The `Walk`: ``("moves", WalkMove s)`` or ``("transfer", `TransferWalk`)``, for any shape of
    ``ndim`` axes (`_plan`). It depends on the meshes and layouts only through their common
    refinement (`_fine_skeleton`): an (8, 8) mesh meeting a (64,) one walks the same (8, 8)
    layouts as two (8, 8) meshes do."""
    if src_mesh == dst_mesh and src == dst:
        return Walk("moves", ())
    ref = _refine(src_mesh, dst_mesh)
    if ref is None:  # incompatible meshes: reduce partials, then everything to everyone
        moves = []
        pdims = tuple(j for j, s in enumerate(src) if isinstance(s, Partial))
        if pdims:
            moves.append(WalkMove("reduce_scatter", tuple(src_mesh), pdims,
                                  divisor(src_mesh, layout_code(src), pdims)))
        moves.append(WalkMove("all_to_all", (math.prod(src_mesh),), (0,), 0))
        return Walk("moves", tuple(moves))
    fine, oa, ob = ref
    return _fine_skeleton(ndim, fine, tuple(map(src.__getitem__, oa)),
                          tuple(map(dst.__getitem__, ob)))


# `_skeleton` of the layouts ``s`` -> ``d`` on the refined mesh ``fine``
_fine_skeleton = memoize(1 << 20, name="sbpflow.auto.evaluate._fine_skeleton")(fine_walk)


def _sized(m: WalkMove, shape: tuple) -> Move:
    """The `Move` of ``m`` for a tensor of ``shape`` (the same arithmetic as the walk's)."""
    numel = math.prod(shape)
    piece = 0.0 if m.div is None else numel if m.div == 0 else numel / m.div
    copy = 0.0
    for layout, axes, g in m.copy:
        local = _local_shape(shape, m.mesh, layout)
        if any(_strided(local, a) for a in axes):
            copy += piece if g is None else piece / g
    return Move(m.kind, m.mesh, m.dims, piece, copy, (), m.fallback)


def _via_transfer(shape: tuple, t: TransferWalk) -> tuple:
    """The planner's reduce-then-transfer for ``shape``: of the options of ``t``, the reduced
    layout that moves fewest bytes per device (the first of them on a tie). The transfer only
    adds bytes, so options are tried in increasing order of their reduction's bytes and the
    rest dropped once that reaches the best total: their loads are never read. The moves are
    made for the chosen option only."""
    fine, s, d, ndim, options = t.fine, t.src, t.dst, t.ndim, t.options
    numel = math.prod(shape)
    if len(options) == 1 and options[0].pre is None:   # no partial dims: the transfer alone
        return _sized_transfer(fine, numel, transfer_fraction(fine, options[0].mid, d, ndim))
    sent: dict = {}   # a reduction's bytes per device, by kind (every option's piece is one)
    tried = []
    for i, (spec, _, _) in enumerate(options):
        vol = 0
        if spec is not None:
            kind, pdims, div, _ = spec
            vol = sent.get(kind)
            if vol is None:
                vol = sent[kind] = _per_device(kind, numel / div,
                                               math.prod(fine[j] for j in pdims))
        tried.append((vol, i))
    best = None   # (bytes, option index, front)
    for vol, i in sorted(tried):
        if best is not None and (vol, i) > best[:2]:
            break   # neither this option nor a later one can move fewer bytes
        front = transfer_fraction(fine, options[i].mid, d, ndim)
        if front:
            vol += front[0][0] * numel
        # the planner's choice: fewest bytes (per device here)
        if best is None or (vol, i) < best[:2]:
            best = (vol, i, front)
    _, i, front = best
    pre = ()
    if options[i].pre is not None:
        kind, pdims, div, ax = options[i].pre
        local = _local_shape(shape, fine, s)
        copy = math.prod(local) if kind == "reduce_scatter" and _strided(local, ax) else 0.0
        pre = (Move(kind, fine, pdims, numel / div, copy),)
    return pre + (_sized_transfer(fine, numel, front) if front else ())


def _sized_transfer(fine: tuple, numel: float, front: tuple) -> tuple:
    """The transfer `Move` (none if nobody receives) of a tensor of ``numel`` elements whose
    receivers' loads are ``front`` (`transfer_fraction`: from most elements to fewest)."""
    if not front:
        return ()
    most = front[0][0] * numel
    # the usual front is one receiver that dominates the others
    loads = ((most, front[0][1]),) if len(front) == 1 else \
        tuple((f * numel, m) for f, m in front)
    return (Move("transfer", fine, tuple(range(len(fine))), most, 0.0, loads),)


@memoize(1 << 14)
def _group_ranks(fine: tuple, dims: tuple) -> tuple:
    strides = [math.prod(fine[j + 1:]) for j in range(len(fine))]
    ranks = [0]
    for j in dims:
        ranks = [r + c * strides[j] for r in ranks for c in range(fine[j])]
    return tuple(sorted(ranks))


def _about(kind: str, piece: float, g: int) -> float:
    """What ``kind``'s formulas are about (`sbpflow.comm.kinds`), given the piece a record of
    this module holds: an all-to-all's is one member's input, the piece over the group."""
    return piece / g if kind == "all_to_all" else piece


def _per_device(kind: str, piece: float, g: int) -> float:
    """What one device of a group of ``g`` sends in ``kind`` about ``piece`` (the kind's
    volume)."""
    return volume(kind, _about(kind, piece, g), g)


def redistribution(shape, src_mesh, src, dst_mesh, dst, itemsize: int = 4, cluster=None,
                   micro_batches: int = 1) -> tuple[float, float]:
    """(seconds, bytes sent per device) of redistributing a tensor of ``shape`` from
    ``(src_mesh, src)`` to ``(dst_mesh, dst)``; seconds need a ``cluster``. With micro-batches
    the activation moves in ``micro_batches`` pieces (same bytes, more latency).

    Seconds, summed over the steps of `redistribution_steps` plus the local (slice) steps:

    * every step, local ones included: ``cluster.step_overhead`` (software cost of a step);
    * a collective: ``cluster.collective_time(kind, n, group)`` (per-kind fit and overhead
      when the cluster has them), plus ``copy_beta`` times the bytes a rank copies through
      strided views: the input of a reduce-scatter / all-to-all cut along an axis that is not
      the leading one of the local shard (``prod(local_shape[:axis]) > 1``), the output of an
      all-gather / all-to-all assembled along such an axis;
    * a transfer (nested splits, below): ``o + m·α + n·β`` with the p2p fit for the busiest
      receiver, ``n`` the bytes and ``m`` the messages it receives, plus ``copy_beta·n`` for
      writing them into its output shard.
    """
    return _walk_price(_skeleton(len(shape), tuple(src_mesh), tuple(src), tuple(dst_mesh),
                                tuple(dst)), tuple(shape), itemsize, cluster, micro_batches)


def _walk_price(walk: Walk, shape: tuple, itemsize: int, cluster,
                micro_batches: int) -> tuple[float, float]:
    """`redistribution` of a tensor of ``shape`` whose walk is ``walk`` (it depends on the
    layouts and meshes only through the walk)."""
    t = b = 0.0
    for m in _sized_walk(walk, shape):
        if cluster is not None:
            t += micro_batches * cluster.step_overhead
        if m.kind == "local":
            continue
        nbytes = m.numel * itemsize
        if m.kind == "transfer":
            b += nbytes
            if cluster is not None:
                fit = _p2p_fit(cluster, m.mesh)
                t += micro_batches * max(
                    _transfer_time(cluster, e * itemsize / micro_batches, msgs, fit)
                    for e, msgs in m.loads)
            continue
        g = math.prod(m.mesh[j] for j in m.dims)
        n = _about(m.kind, nbytes, g)
        b += volume(m.kind, n, g)
        if cluster is not None:
            t += micro_batches * _coll_time(cluster, m.kind, n / micro_batches, m.mesh, m.dims)
            if m.copy:
                t += cluster.copy_time(m.copy * itemsize)
    return t, b


def redistribution_floor(shape, src_mesh, src, dst_mesh, dst, itemsize: int, cluster,
                         micro_batches: int = 1) -> float | None:
    """None when the redistribution is the fixed order's moves, whose price is cheap once
    the walk is known (price it instead); else a lower bound of ``redistribution(...)[0]``
    (seconds) found from the walk alone, before any receiver's load is: the least over the
    planner's reduce-then-transfer options of the reduction's price plus the transfer's
    price for rank 0's load (rank 0, at coordinate 0 of the mesh, receives no more elements
    than the busiest receiver, and at least one message), at the mesh's p2p fit, the one
    the price uses (inter-node for a mesh across nodes, so this is far above
    `edge_lower_bounds`' least link). The price's terms, added in its order, each at most
    the price's; scaled by ``1 - 1e-9`` like the dense bounds."""
    walk = _skeleton(len(shape), tuple(src_mesh), tuple(src), tuple(dst_mesh), tuple(dst))
    if walk.how != "transfer":
        return None
    return _transfer_floor(walk.body, shape, itemsize, cluster, micro_batches)


def _transfer_floor(sk: TransferWalk, shape: tuple, itemsize: int, cluster,
                    micro_batches: int) -> float:
    """`redistribution_floor` of a tensor of ``shape`` whose walk is the transfer ``sk``."""
    fine = sk.fine
    numel, m = math.prod(shape), micro_batches
    fit, step = _p2p_fit(cluster, fine), m * cluster.step_overhead
    # `_via_transfer`'s options, each priced as it would be: the options of one reduction
    # kind reduce the same piece, and a transfer's time grows with its load, so of each kind
    # the option with the least load is the least (`TransferWalk.least`)
    least = math.inf
    for kind, pdims, div, g, lack in sk.least:
        t = 0.0
        if kind is not None:
            n = _about(kind, numel / div * itemsize, g)
            t += step
            t += m * _coll_time(cluster, kind, n / m, fine, pdims)
        if lack > 1e-12:   # rank 0 receives: the transfer has a receiver
            t += step
            # (the load's elements are rounded to 1e-12: below them by more than that)
            t += m * _transfer_time(cluster, (lack - 1e-12) * numel * itemsize / m, 1, fit)
        least = min(least, t)
    return least * (1 - 1e-9)


def _transfer_time(cluster, nbytes, msgs, fit):
    """A point-to-point transfer in which the busiest rank receives ``nbytes`` in ``msgs``
    messages: ``o + msgs·α + nbytes·β`` (plus ``copy_beta·nbytes``: the pieces are written
    into the receiver's output shard) with ``fit``, the p2p parameters of the whole mesh's
    link class (`_p2p_fit`; ``o`` = 0 without a per-kind fit). An estimate of what
    `sbpflow.cost.step_time` gives the planner's transfer step: that one prices each message
    on the link of its own pair and takes the larger of a rank's sends and receives (equal on
    one node, when every rank receives at least what it sends)."""
    return fit.time(msgs, nbytes) + cluster.copy_time(nbytes)


def _p2p_fit(cluster, fine: tuple):
    """`_transfer_time`'s p2p fit of the mesh ``fine``, looked up once per mesh (`_FIT_CACHE`:
    a search asks for it once per transfer priced)."""
    key = (id(cluster), "p2p", fine, None)
    hit = _FIT_CACHE.get(key)
    if hit is None or hit[0] is not cluster:
        ranks = _group_ranks(fine, tuple(range(len(fine))))
        hit = _FIT_CACHE.put(key, (cluster, cluster.fit("p2p", ranks[:1] + ranks[-1:])))
    return hit[1]


# (id(cluster), kind, mesh, dims) -> (cluster, fit): an entry holds its cluster, so the id is
# not reused while the entry lives (clusters may hold unhashable fit tables)
_FIT_CACHE = BoundedDict("auto.collective_fits", 1 << 16)


def _coll_time(cluster, kind, nbytes, fine, dims):
    """Time of one collective over the group of ``dims`` of the fine mesh that holds rank 0
    (groups along a dim are translates of it, so they cross node boundaries alike when the
    mesh dims align with nodes; they do for meshes whose dims are divisors in row-major):
    `sbpflow.cost.Cluster.collective_time`, with the group's fit and linear form found once
    per group (`linear_time`; the walks make linear kinds only)."""
    key = (id(cluster), kind, fine, dims)
    hit = _FIT_CACHE.get(key)
    if hit is None or hit[0] is not cluster:
        ranks = _group_ranks(fine, dims)
        hit = _FIT_CACHE.put(key, (cluster, linear_time(kind, len(ranks),
                                                        cluster.fit(kind, ranks))))
    return hit[1].time(nbytes)


def _axis_factors(layouts: list, ndim: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per ``(mesh, nd-sbp)``: the split factor of every tensor axis; whether the layout has a
    partial dim (column 0), a broadcast dim (1), a partial other than a sum (2); the product
    of the mesh dims that are partial (column 0) and broadcast (1)."""
    f = np.ones((len(layouts), ndim))
    kind = np.zeros((len(layouts), 3), dtype=bool)
    group = np.ones((len(layouts), 2))
    for i, (mesh, nd) in enumerate(layouts):
        for x, m in zip(nd, mesh):
            if isinstance(x, Split):
                f[i, x.axis] *= m
            elif isinstance(x, Partial):
                group[i, 0] *= m
            else:
                group[i, 1] *= m
        kind[i] = (any(isinstance(x, Partial) for x in nd),
                   any(isinstance(x, Broadcast) for x in nd),
                   any(isinstance(x, Partial) and x.op != "sum" for x in nd))
    return f, kind, group


def _reduced_piece(fs, gs, fd) -> np.ndarray:
    """Per source row and destination column: a lower bound of the fraction of the tensor a
    rank sends reducing the source's partial (sum) dims, for a destination without partials.
    Every price reduces them first (`walk.fine_walk`'s reduce-scatter / all-reduce phases, the
    reduce-then-transfer options, the incompatible meshes' reduce-scatter) over their group
    of ``g`` ranks, about a piece of at least the source box ``x`` cut by the local slices
    before it (broadcast source dims that split in the destination: at most the broadcast
    dims' product ``b``, at most the destination's split product ``F``); a reduce-scatter
    sends ``(g-1)/g`` of its piece (a ring all-reduce twice that, a direct one ``g-1``), and
    a reduce-scatter then all-reduce over parts of the group no less. So: ``(g-1)/g * x /
    min(b, F)``. ``fs`` / ``fd``: split factors, ``gs``: partial and broadcast products
    (`_axis_factors`)."""
    g, b = gs[:, 0], gs[:, 1]
    x = 1.0 / fs.prod(axis=1)
    cut = np.minimum(b[:, None], fd.prod(axis=1)[None, :])
    return ((g - 1) / g * x)[:, None] / cut


def _lacks(own_s, own_d, ps, pd, red):
    """Fraction of the tensor rank 0 must receive going from a layout where it holds
    ``own_s`` (per axis) to one where it holds ``own_d``; ``ps`` / ``pd``: the layouts have
    a partial dim. No partial: what it lacks of its new box. A partial source into a
    destination without partials: its whole new box (every reduction the price uses sends a
    rank at least the reduced piece it keeps, and what it lacks after that comes later), or
    what the reduction sends, ``red`` (`_reduced_piece`), if more. Otherwise 0."""
    both = np.minimum(own_s[:, None, :], own_d[None, :, :]).prod(axis=2)
    box = own_d.prod(axis=1)[None, :]
    lack = np.clip(box - both, 0.0, None)
    plain = ~ps[:, None] & ~pd[None, :]
    reduce = ps[:, None] & ~pd[None, :]
    return np.where(plain, lack, 0.0) + np.where(reduce, np.maximum(box, red), 0.0)


def _least_beta(cluster) -> float:
    """The least seconds per byte any group of two or more ranks of ``cluster`` is priced at:
    of the link classes such a group can have (``intra`` needs two devices on a node,
    ``inter`` two nodes; a one-rank group costs nothing), their links' and per-kind fits'."""
    classes = [lc for lc, ok in (("intra", cluster.devices_per_node > 1),
                                 ("inter", cluster.nodes > 1)) if ok]
    betas = [getattr(cluster, lc).beta for lc in classes] + \
        [f.beta for lc, _, f in cluster.kinds if lc in classes]
    return min(betas, default=0.0)


def _least_fixed(cluster) -> float:
    """The least seconds a move in which a rank receives costs besides its bytes: of the link
    classes a group of two or more ranks can have, the least per-message ``alpha`` (plus a
    per-kind fit's ``overhead``); every collective and transfer sends a receiver at least
    one message (`sbpflow.cost.formulas`: ``messages(p) >= 1`` for ``p >= 2``)."""
    classes = [lc for lc, ok in (("intra", cluster.devices_per_node > 1),
                                 ("inter", cluster.nodes > 1)) if ok]
    fixed = [getattr(cluster, lc).alpha for lc in classes] + \
        [f.overhead + f.alpha for lc, _, f in cluster.kinds if lc in classes]
    return min(fixed, default=0.0)


def _node_side(layouts: list, ndim: int, cluster) -> tuple:
    """Per ``(mesh, nd-sbp)``, what node 0 (ranks ``0 .. k-1``, ``k`` devices a node) holds:
    per axis the fraction ``[0, x)`` of it (the union of its ranks' boxes: mesh dims are
    row-major, the first dim outermost, so node 0 has coordinate 0 on the dims above the node,
    every coordinate on the dims inside it and a prefix on a dim across the boundary: a prefix
    of every axis); whether a partial (column 0) or broadcast (1) dim reaches other nodes; and
    whether the layout qualifies (its mesh covers the cluster and every mesh dim is aligned
    with nodes: each suffix product divides ``k`` or is a multiple of it, so every group of
    a move crosses nodes as rank 0's does)."""
    k, world = cluster.devices_per_node, cluster.world_size
    own = np.ones((len(layouts), ndim))
    spans = np.zeros((len(layouts), 2), dtype=bool)
    ok = np.zeros(len(layouts), dtype=bool)
    for i, (mesh, nd) in enumerate(layouts):
        stride = [math.prod(mesh[j + 1:]) for j in range(len(mesh))]
        if math.prod(mesh) != world or any(c % k and k % c for c in stride + [world]):
            continue
        ok[i] = True
        for x, m, st in zip(nd, mesh, stride):
            outer = m if st >= k else max(1, m * st // k)   # the dim's part above the node
            if isinstance(x, Split):
                own[i, x.axis] /= outer
            elif outer > 1:
                spans[i, 0 if isinstance(x, Partial) else 1] = True
    return own, spans, ok


def _node_lacks(src: tuple, dst: tuple, pd, col: int) -> np.ndarray:
    """Fraction of the tensor node 0 must receive from other nodes going from the layouts of
    ``src`` to those of ``dst`` (`_node_side` arrays; ``pd``: the destinations have a partial
    dim, ``col``: the ``spans`` column that is partial in this direction): what it
    lacks of its new region (products of prefixes: the product of the per-axis minima is the
    overlap), all of it when a source partial dim reaches other nodes (no element is then
    summed within node 0). A partial destination, or a layout not qualifying: 0."""
    (own_s, sp_s, ok_s), (own_d, _, ok_d) = src, dst
    both = np.minimum(own_s[:, None, :], own_d[None, :, :]).prod(axis=2)
    box = own_d.prod(axis=1)[None, :]
    lack = np.where(sp_s[:, col][:, None], box, np.clip(box - both, 0.0, None))
    return np.where(ok_s[:, None] & ok_d[None, :] & ~pd[None, :], lack, 0.0)


def _layout_meshes(layouts: list) -> tuple[list, np.ndarray]:
    """The distinct meshes of ``(mesh, nd-sbp)`` pairs and each pair's index among them."""
    index: dict = {}
    of = np.array([index.setdefault(m, len(index)) for m, _ in layouts], dtype=np.int64)
    return list(index), of


def _inter_beta(cluster) -> float:
    """The least seconds per byte a group across nodes is priced at (link and per-kind fits),
    divided by the devices a node has: node 0's ``k`` ranks each receive at most a move's
    per-device volume, so what enters node 0 costs at least this per byte (0: one node)."""
    if cluster.nodes < 2:
        return 0.0
    betas = [cluster.inter.beta] + [f.beta for lc, _, f in cluster.kinds if lc == "inter"]
    return min(betas) / min(cluster.devices_per_node, cluster.world_size)


class _BoundSide(NamedTuple):
    """One side of `edge_lower_bounds`: the arrays of its distinct layout features (what the
    bound reads of a layout: split factors, kinds, groups and, with ``node``, `_node_side`),
    each layout's row among them (``of``), the distinct meshes and each layout's (``mesh_of``).
    A table's layouts are many (1,039 producer layouts in a GPT-3 stage) but their features
    few (352), so the bound is found on the distinct features and gathered once."""

    f: np.ndarray
    kind: np.ndarray
    group: np.ndarray
    node: tuple | None
    of: np.ndarray
    meshes: list
    mesh_of: np.ndarray


# (layout, (ndim, node-side key)) -> the layout's features as floats (`_bound_rows`)
_BOUND_ROWS = BoundedDict("auto.bound_rows", 1 << 16)


def _bound_rows(layouts: list, ndim: int, cluster, node: bool) -> list:
    """Each ``(mesh, nd-sbp)`` layout's features as one tuple of floats: `_axis_factors`,
    then with ``node`` `_node_side` (cached: a table's layouts recur in the search's other
    tables; the missing ones are found together)."""
    tag = (ndim, (cluster.devices_per_node, cluster.world_size) if node else None)
    rows = {l: _BOUND_ROWS.get((l, tag)) for l in layouts}
    missing = [l for l, r in rows.items() if r is None]
    if missing:
        parts = list(_axis_factors(missing, ndim))
        if node:
            own, spans, ok = _node_side(missing, ndim, cluster)
            parts += [own, spans, ok[:, None]]
        feat = np.concatenate([np.asarray(x, dtype=np.float64) for x in parts], axis=1)
        for l, row in zip(missing, feat.tolist()):
            rows[l] = _BOUND_ROWS.put((l, tag), tuple(row))
    return [rows[l] for l in layouts]


# (id(layouts), ndim, node-side key) -> (a copy of layouts, side): an edge table asks for the
# bounds of its rows and columns three times (both directions, forward, backward); the copy
# is compared on every hit (its items are the list's own, so that is cheap), so a list
# reused or changed in place gets its own side
_BOUND_SIDES = BoundedDict("auto.bound_sides", 1 << 10)


def _bound_side(layouts: list, ndim: int, cluster, node: bool) -> _BoundSide:
    """The `_BoundSide` of ``layouts`` (the floats are the ones the per-layout arrays hold)."""
    key = (id(layouts), ndim, (cluster.devices_per_node, cluster.world_size) if node else None)
    hit = _BOUND_SIDES.get(key)
    if hit is None or hit[0] != layouts:
        hit = _BOUND_SIDES.put(key, (list(layouts), _new_bound_side(layouts, ndim, cluster,
                                                                    node)))
    return hit[1]


def _new_bound_side(layouts: list, ndim: int, cluster, node: bool) -> _BoundSide:
    index: dict = {}
    of = np.array([index.setdefault(r, len(index))
                   for r in _bound_rows(layouts, ndim, cluster, node)], dtype=np.int64)
    feat = np.array(list(index), dtype=np.float64).reshape(len(index), -1)
    # the columns `_bound_rows` concatenates: `_axis_factors`' then `_node_side`'s arrays
    widths = [ndim, 3, 2] + ([ndim, 2, 1] if node else [])
    cols = np.split(feat, np.cumsum(widths)[:-1], axis=1)
    side = (cols[3], cols[4] != 0, cols[5][:, 0] != 0) if node else None
    meshes, mesh_of = _layout_meshes(layouts)
    return _BoundSide(cols[0], cols[1] != 0, cols[2], side, of, meshes, mesh_of)


def _bound_matrix(src: _BoundSide, dst: _BoundSide, beta: float, bx: float, nbytes: float,
                  lat: float, part: str = "both") -> np.ndarray:
    """`edge_lower_bounds` between the distinct features of ``src`` and ``dst``, with the
    node bound when ``bx > 0`` (for meshes with a common refinement); ``part``: of both
    directions, or of the ``"forward"`` or ``"backward"`` one alone."""
    own_s, own_d = 1.0 / src.f, 1.0 / dst.f
    ks, kd = src.kind, dst.kind
    fwd = _lacks(own_s, own_d, ks[:, 0], kd[:, 0], _reduced_piece(src.f, src.group, dst.f)) \
        * beta
    # backward: dual(input) -> dual(output); a dual has a partial where the layout broadcasts
    # (and a broadcast where it has a partial)
    bwd = _lacks(own_d, own_s, kd[:, 1], ks[:, 1],
                 _reduced_piece(dst.f, dst.group[:, ::-1], src.f)).T * beta
    if bx > 0:
        fwd = np.maximum(fwd, _node_lacks(src.node, dst.node, kd[:, 0], 0) * bx)
        bwd = np.maximum(bwd, _node_lacks(dst.node, src.node, ks[:, 1], 1).T * bx)
    odd = ks[:, 2][:, None] | kd[:, 2][None, :]    # non-sum partials: no bound (rare)
    if part == "backward":
        total = bwd * nbytes + lat * (bwd > 0)
    elif part == "forward":
        total = fwd * nbytes + lat * (fwd > 0)
    else:
        total = (fwd + bwd) * nbytes + lat * ((fwd > 0) * 1.0 + (bwd > 0))
    return np.where(odd, 0.0, total) * (1 - 1e-9)


def edge_lower_bounds(shape: tuple, itemsize: int, cluster, rows: list, cols: list,
                      micro_batches: int = 1, part: str = "both") -> np.ndarray:
    """A lower bound of every edge time between producer layouts ``rows`` and consumer input
    layouts ``cols`` (``(mesh, nd-sbp)`` pairs), as a dense matrix, per direction (forward,
    and backward: the duals, broadcast <-> partial) the larger of two: the elements rank 0
    must receive (`_lacks`) at the least seconds per byte a group of the cluster can be
    charged (`_least_beta`); the elements node 0 must receive from other nodes
    (`_node_lacks`) at `_inter_beta`. Rank 0 sits at coordinate 0 of every mesh, so it holds
    ``[0, 1/f_a)`` of every axis ``a`` split ``f_a`` ways, and every move the price sums sends
    each receiver at least what it gets (a collective's volume, a transfer's busiest
    receiver); the node bound needs real moves: meshes of at most ``TRANSFER_MAX_RANKS``
    ranks with a common refinement (else the price holds estimates). A direction in which
    rank 0 must receive something also has at least one move in which it does, so, once a
    micro-batch, a step's overhead and the least fixed cost of a message (`_least_fixed`).
    Scaled by ``1 - 1e-9`` against rounding. Found on distinct layout features
    (`_BoundSide`) and gathered: the same floats as layout by layout. ``part``:
    ``"forward"`` / ``"backward"``, the bound of that direction alone
    (`Evaluator.edge_forward`, `Evaluator.edge_backward`)."""
    if part not in ("both", "forward", "backward"):
        raise ValueError(f"edge_lower_bounds: part must be 'both', 'forward' or 'backward', "
                         f"got {part!r}")
    beta = _least_beta(cluster)
    nd = len(shape)
    if beta <= 0 or not rows or not cols:
        return np.zeros((len(rows), len(cols)))
    bx = _inter_beta(cluster)
    # one device a node: node 0 is rank 0, and the rank bound is as tight
    node = bx > 0 and cluster.devices_per_node > 1 and cluster.world_size <= TRANSFER_MAX_RANKS
    src, dst = _bound_side(rows, nd, cluster, node), _bound_side(cols, nd, cluster, node)
    lat = micro_batches * (cluster.step_overhead + _least_fixed(cluster))
    nbytes = math.prod(shape) * itemsize
    pick = np.ix_(src.of, dst.of)
    if not node:
        return _bound_matrix(src, dst, beta, 0.0, nbytes, lat, part)[pick]
    with_node = _bound_matrix(src, dst, beta, bx, nbytes, lat, part)[pick]
    # the node bound holds between meshes with a common refinement (usually all of them)
    ref = np.array([[_refine(a, b) is not None for b in dst.meshes] for a in src.meshes])
    if ref.all():
        return with_node
    rank = _bound_matrix(src, dst, beta, 0.0, nbytes, lat, part)[pick]
    return np.where(ref[np.ix_(src.mesh_of, dst.mesh_of)], with_node, rank)


# ---- per-layer and per-edge terms --------------------------------------------------------------
def _local_numel(shape, mesh, nd):
    n = math.prod(shape)
    for s, m in zip(nd, mesh):
        if isinstance(s, Split):
            n /= m
    return n


def _work_split(s) -> int:
    """How many ways a layer's work is divided under strategy ``s``: the product of the mesh
    dims that split one of its operands (input, weight or output). On the other dims every
    device does the dim's whole work: replicated (``rep``), or a partial input kept unreduced
    (``pin``: each device multiplies a whole-size partial sum). (A vocabulary-split embedding
    counts as divided: its lookups are a negligible part of any model's work.)"""
    n, inp, out, w = 1, s.input, s.output, s.weight
    for d, size in enumerate(s.mesh):   # (plain tests: every candidate of every layer asks)
        if isinstance(inp[d], Split) or isinstance(out[d], Split) or \
                (w is not None and isinstance(w[d], Split)):
            n *= size
    return n


@dataclass
class Breakdown:
    """Predicted cost of one strategy (times in seconds, bytes per device)."""

    time: float = 0.0
    compute_time: float = 0.0
    forward_time: float = 0.0      # activation redistributions, forward
    backward_time: float = 0.0     # activation-gradient redistributions, backward
    grad_sync_time: float = 0.0    # weight-gradient sync (and ZeRO weight gathers)
    gather_time: float = 0.0       # of which ZeRO weight gathers (every micro-batch)
    forward_bytes: float = 0.0
    backward_bytes: float = 0.0
    grad_sync_bytes: float = 0.0
    memory: dict = field(default_factory=dict)   # params, grads, optimizer, activations, total
    per_layer: dict = field(default_factory=dict)  # name -> time, compute, bytes, memory
    micro_batches: int = 1
    # pipelines (`sbpflow.auto.pipeline_cost`): per stage its time per micro-batch and memory per
    # device; the stage-to-stage transfers on the critical path; the bubble's share of time
    stages: int = 1
    schedule: str = ""
    stage_times: list = field(default_factory=list)
    stage_memory: list = field(default_factory=list)
    transfer_time: float = 0.0
    bubble_time: float = 0.0

    @property
    def comm_time(self) -> float:
        """Predicted communication seconds of a step: forward + backward + gradient
        synchronisation."""
        return self.forward_time + self.backward_time + self.grad_sync_time

    @property
    def bytes(self) -> float:
        """Bytes a device sends in a step: forward + backward + gradient synchronisation."""
        return self.forward_bytes + self.backward_bytes + self.grad_sync_bytes

    def __str__(self) -> str:
        gb = 1 << 30
        m = self.memory
        return (f"time {self.time * 1e3:.3f} ms (compute {self.compute_time * 1e3:.3f}, comm "
                f"{self.comm_time * 1e3:.3f}: fwd {self.forward_time * 1e3:.3f}, bwd "
                f"{self.backward_time * 1e3:.3f}, grad sync {self.grad_sync_time * 1e3:.3f})\n"
                f"bytes/device: fwd {self.forward_bytes / 1e6:.2f} MB, bwd "
                f"{self.backward_bytes / 1e6:.2f} MB, grad sync {self.grad_sync_bytes / 1e6:.2f} MB\n"
                f"memory/device: params {m.get('params', 0) / gb:.2f} GiB, grads "
                f"{m.get('grads', 0) / gb:.2f}, optimizer {m.get('optimizer', 0) / gb:.2f}, "
                f"activations {m.get('activations', 0) / gb:.2f}, total "
                f"{m.get('total', 0) / gb:.2f} GiB (micro-batches {self.micro_batches})"
                + self._pipeline_line())

    def _pipeline_line(self) -> str:
        if self.stages <= 1:
            return ""
        gb = 1 << 30
        return (f"\npipeline: {self.stages} stages, {self.micro_batches} micro-batches "
                f"{self.schedule}; per micro-batch (ms) "
                + " ".join(f"{t * 1e3:.3f}" for t in self.stage_times)
                + f"; bubble {self.bubble_time * 1e3:.3f} ms, transfers "
                f"{self.transfer_time * 1e3:.3f} ms; memory/device per stage (GiB) "
                + " ".join(f"{m / gb:.2f}" for m in self.stage_memory))


def _no_backward(a_out: tuple, b_in: tuple) -> bool:
    """An edge has no backward redistribution after a partial other than a sum (its gradient
    is not a redistribution: `sbpflow.sbp.dual_nd`)."""
    return any(isinstance(x, Partial) and x.op != "sum" for x in b_in + a_out)


@memoize(1 << 17)
def _gradient_layouts(a_out: tuple, b_in: tuple) -> tuple | None:
    """``(dual(b_in), dual(a_out))``: the layouts an edge's gradient moves from and to, or
    None when it has no backward redistribution (`_no_backward`); asked for at every
    backward floor, price and batch of loads."""
    return None if _no_backward(a_out, b_in) else (dual_nd(b_in), dual_nd(a_out))


def _price_key(shape, a_mesh, a, b_mesh, b, micro) -> tuple:
    """The key of `Evaluator._redist`'s memo (`Evaluator.find_loads` reads it too)."""
    return shape, a_mesh, a, b_mesh, b, micro


# prices an evaluator keeps (`Evaluator._redist`): a GPT-3 stage's exhaustive search asks
# for about 200k distinct ones, a few hundred bytes each
_PRICES_KEPT = 1 << 19


class Evaluator:
    """Per-layer and per-edge cost terms for one (graph, cluster), cached. The cost of a
    strategy is the sum of ``node`` over layers and ``edge`` over the graph's edges."""

    def __init__(self, graph, cluster, micro_batches: int = 1, shared: dict | None = None):
        """``shared``: the caches' dicts, shared by evaluators of graphs cut from one model
        (a pipeline's stages) on the same cluster and micro-batch count (the caches are
        keyed by layer keys and layouts, not by layer names)."""
        self.graph, self.cluster, self.micro = graph, cluster, int(micro_batches)
        self.itemsize = graph.itemsize
        shared = {} if shared is None else shared
        self._node: dict = shared.setdefault("node", {})
        self._mem: dict = shared.setdefault("memory", {})
        self._edge: dict = shared.setdefault("edge", {})
        self._prices: dict = shared.setdefault("prices", {})
        # prices and transfer floors by (`Walk`, shape[, micro]): the walk holds its layouts
        self._walk_prices: dict = shared.setdefault("walk_prices", {})
        self._floors: dict = shared.setdefault("floors", {})
        # the transfer walks whose loads `find_loads` found (a cleared loads memo is only
        # slower: a price then finds what it reads itself)
        self._loaded: set = shared.setdefault("loaded", set())

    def _redist(self, shape, a_mesh, a, b_mesh, b, micro=1):
        """`redistribution` ``(seconds, bytes)`` on this cluster, memoised: a layer's
        candidates share few weight and output layouts (GPT-3: 28,663 gradient syncs asked
        for in a default search, 9,627 distinct), and an edge direction the search bounded
        by its walk (`edge_forward_floor`) is asked for again when the entry is priced."""
        key = _price_key(shape, a_mesh, a, b_mesh, b, micro)
        hit = self._prices.get(key)
        if hit is None:
            if len(self._prices) >= _PRICES_KEPT:
                for memo in (self._prices, self._walk_prices, self._floors, self._loaded):
                    memo.clear()
            # layout pairs whose meshes refine to one walk share its price (VGG-13: 40 % of
            # the prices a search asks for)
            walk = _skeleton(len(shape), tuple(a_mesh), tuple(a), tuple(b_mesh), tuple(b))
            wkey = (walk, shape, micro)
            hit = self._walk_prices.get(wkey)
            if hit is None:
                hit = self._walk_prices[wkey] = _walk_price(walk, tuple(shape), self.itemsize,
                                                           self.cluster, micro)
            self._prices[key] = hit
        return hit

    def find_loads(self, shape: tuple, pairs: list, forward: list, backward: bool) -> None:
        """Before the edge entries ``pairs`` (``((a_mesh, a_out), (b_mesh, b_in))`` each, of a
        tensor of ``shape``) are priced: the transfer loads their prices will read, found in
        one batch (`find_fractions`), a numpy pass for all instead of one each; the forward
        direction where ``forward[k]``, the backward with ``backward``, directions already
        priced left out. The prices that follow read them from the memo, unchanged."""
        walks, micro, prices, loaded = [], self.micro, self._prices, self._loaded
        for ((am, ao), (bm, bi)), fwd in zip(pairs, forward):
            if fwd and _price_key(shape, am, ao, bm, bi, micro) not in prices:
                walks.append(_skeleton(len(shape), am, ao, bm, bi))
            grad = _gradient_layouts(ao, bi) if backward else None
            if grad is not None and \
                    _price_key(shape, bm, grad[0], am, grad[1], micro) not in prices:
                walks.append(_skeleton(len(shape), bm, grad[0], am, grad[1]))
        # a walk's loads are found once (for any shape: they are fractions of the tensor)
        walks = [w for w in dict.fromkeys(walks) if w.how == "transfer" and w not in loaded]
        find_fractions([k for w in walks for k in w.body.keys])
        loaded.update(walks)

    def node_memory(self, layer, s) -> dict:
        """Memory per device of one layer (bytes): ``params``, ``grads``, ``optimizer``,
        ``activations`` (per micro-batch in flight) and their ``total``; no pricing."""
        key = (layer.key, s)
        hit = self._mem.get(key)
        if hit is not None:
            return hit
        mesh, it = s.mesh, self.itemsize
        g = self.graph
        mem = {"params": 0.0, "grads": 0.0, "optimizer": 0.0, "activations": 0.0}
        if layer.weight_shape is not None:
            ws = tuple(layer.weight_shape)
            if s.zero in (1, 2):   # docs/auto.md, 'ZeRO stages': the weight kept whole
                whole, split = _local_numel(ws, mesh, s.weight), _local_numel(ws, mesh, s.stored)
                mem["params"] = whole * it
                mem["grads"] = (split if s.zero == 2 else whole) * it
                mem["optimizer"] = split * g.optimizer_itemsize * g.optimizer_states
            else:
                n = _local_numel(ws, mesh, s.weight_stored)
                mem["params"] = mem["grads"] = n * it
                mem["optimizer"] = n * g.optimizer_itemsize * g.optimizer_states
        # saved for backward: the input and the output (a recomputed layer only its input)
        saved = _local_numel(layer.input_shape, mesh, s.input)
        if not getattr(s, "recompute", False):
            saved += _local_numel(layer.output_shape, mesh, s.output)
        mem["activations"] = saved * it / self.micro
        mem["total"] = sum(mem.values())
        self._mem[key] = mem
        return mem

    def node_terms(self, layer, s) -> dict:
        """compute, grad-sync (time, bytes), sink reduction (fwd/bwd), memory of one layer."""
        idx = self.graph.index.get(layer.name)
        sink = idx is not None and not self.graph.succs[idx]
        key = (layer.key, s, sink)
        hit = self._node.get(key)
        if hit is not None:
            return hit
        mesh, m = s.mesh, self.micro
        # forward + backward (2x forward); recomputation runs the forward once more
        passes = 4.0 if getattr(s, "recompute", False) else 3.0
        compute = passes * layer.flops / _work_split(s) / self.cluster.device_flops
        gt = gb = gather = 0.0
        if layer.weight_shape is not None and s.zero in (1, 2):
            gt, gb = self._zero12(layer, s)
        elif layer.weight_shape is not None:
            w, st, ws = s.weight, s.weight_stored, tuple(layer.weight_shape)
            t, b = self._redist(ws, mesh, dual_nd(w), mesh, st)   # gradient -> param layout
            gt, gb = gt + t, gb + b
            if st != w:  # ZeRO-3: gather the weight for forward and again for backward
                t, b = self._redist(ws, mesh, st, mesh, w)
                gt, gb, gather = gt + 2 * m * t, gb + 2 * m * b, 2 * m * t
        ft, fb, bt, bb = self._sink_terms(layer, s) if sink else (0.0, 0.0, 0.0, 0.0)
        out = {"compute": compute, "grad_time": gt, "grad_bytes": gb, "fwd_time": ft,
               "fwd_bytes": fb, "bwd_time": bt, "bwd_bytes": bb,
               "memory": self.node_memory(layer, s), "gather_time": gather,
               "time": compute + gt + ft + bt}
        self._node[key] = out
        return out

    def _sink_terms(self, layer, s) -> tuple:
        """(fwd time, bytes, bwd time, bytes) of a sink layer: the loss needs a full value,
        so a partial output is reduced (and its gradient sent back the dual way)."""
        if not any(isinstance(x, Partial) for x in s.output):
            return 0.0, 0.0, 0.0, 0.0
        mesh, m = s.mesh, self.micro
        red = tuple(S(0) if isinstance(x, Partial) else x for x in s.output)
        shape = tuple(layer.output_shape)
        ft, fb = self._redist(shape, mesh, s.output, mesh, red, m)
        bt, bb = self._redist(shape, mesh, dual_nd(red), mesh, dual_nd(s.output), m)
        return ft, fb, bt, bb

    def _zero12(self, layer, s) -> tuple:
        """(grad-sync time, bytes) of a weight at ZeRO stage 1 or 2 (docs/auto.md, 'ZeRO
        stages'): the gradient reduce-scattered to ``stored`` and the updated shard
        all-gathered back, once a step (data parallelism's bytes)."""
        w, st, ws, mesh = s.weight, s.stored, tuple(layer.weight_shape), s.mesh
        t1, b1 = self._redist(ws, mesh, dual_nd(w), mesh, st)
        t2, b2 = self._redist(ws, mesh, st, mesh, w)
        return t1 + t2, b1 + b2

    def edge_terms(self, producer, a, consumer, b) -> dict:
        """Forward redistribution of the producer's output into the consumer's input layout
        and the dual redistribution of its gradient in backward."""
        shape = tuple(producer.output_shape)
        b_in = _clip_axis(b.input, len(shape))
        key = (shape, a.mesh, a.output, b.mesh, b_in)
        hit = self._edge.get(key)
        if hit is not None:
            return hit
        ft, fb, bt, bb = self._edge_pair(shape, a.mesh, a.output, b.mesh, b_in)
        out = {"fwd_time": ft, "fwd_bytes": fb, "bwd_time": bt, "bwd_bytes": bb,
               "time": ft + bt}
        self._edge[key] = out
        return out

    def edge_time(self, shape: tuple, a_mesh: tuple, a_out: tuple, b_mesh: tuple,
                  b_in: tuple) -> float:
        """``edge_terms(...)["time"]`` from the layouts alone (``b_in`` already clipped to the
        tensor's axes), not cached here: the search's edge tables are the cache."""
        ft, _, bt, _ = self._edge_pair(shape, a_mesh, a_out, b_mesh, b_in)
        return ft + bt

    def edge_forward(self, shape: tuple, a_mesh: tuple, a_out: tuple, b_mesh: tuple,
                     b_in: tuple) -> float:
        """The forward part of `edge_time` (its first term)."""
        return self._redist(shape, a_mesh, a_out, b_mesh, b_in, self.micro)[0]

    def edge_backward(self, shape: tuple, a_mesh: tuple, a_out: tuple, b_mesh: tuple,
                      b_in: tuple) -> float:
        """The backward part of `edge_time` (its second term)."""
        return self._edge_backward(shape, a_mesh, a_out, b_mesh, b_in)[0]

    def _edge_backward(self, shape, a_mesh, a_out, b_mesh, b_in):
        """(seconds, bytes) of the gradient's dual redistribution (`_no_backward`: none)."""
        grad = _gradient_layouts(a_out, b_in)
        if grad is None:
            return 0.0, 0.0
        return self._redist(shape, b_mesh, grad[0], a_mesh, grad[1], self.micro)

    def edge_forward_floor(self, shape: tuple, a_mesh: tuple, a_out: tuple, b_mesh: tuple,
                           b_in: tuple) -> tuple[float, bool]:
        """``(seconds, exact)``: `edge_forward` when its walk is the fixed order's moves (cheap
        to price once the walk is known), else `redistribution_floor`'s lower bound of it
        (a transfer's loads not found)."""
        return self._floor(shape, a_mesh, a_out, b_mesh, b_in)

    def edge_backward_floor(self, shape: tuple, a_mesh: tuple, a_out: tuple, b_mesh: tuple,
                            b_in: tuple) -> tuple[float, bool]:
        """`edge_backward` or a lower bound of it, as `edge_forward_floor`."""
        grad = _gradient_layouts(a_out, b_in)
        if grad is None:
            return 0.0, True
        return self._floor(shape, b_mesh, grad[0], a_mesh, grad[1])

    def _floor(self, shape, a_mesh, a, b_mesh, b) -> tuple[float, bool]:
        """`redistribution_floor`, kept by walk and shape (`Walk`), or the price when the
        walk is the fixed order's moves (exact: True)."""
        walk = _skeleton(len(shape), tuple(a_mesh), tuple(a), tuple(b_mesh), tuple(b))
        if walk.how != "transfer":
            return self._redist(shape, a_mesh, a, b_mesh, b, self.micro)[0], True
        key = (walk, shape)
        floor = self._floors.get(key)
        if floor is None:
            if len(self._floors) >= _PRICES_KEPT:
                self._floors.clear()
            floor = self._floors[key] = _transfer_floor(walk.body, shape, self.itemsize,
                                                       self.cluster, self.micro)
        return floor, False

    def _edge_pair(self, shape, a_mesh, a_out, b_mesh, b_in):
        ft, fb = self._redist(shape, a_mesh, a_out, b_mesh, b_in, self.micro)
        bt, bb = self._edge_backward(shape, a_mesh, a_out, b_mesh, b_in)
        return ft, fb, bt, bb

    def breakdown(self, strategy) -> Breakdown:
        """The priced `Breakdown` of ``strategy`` (a `Strategy` or a sequence of
        `LayerStrategy`, one a layer): times, bytes and memory per device."""
        g = self.graph
        layers = strategy.layers if hasattr(strategy, "layers") else list(strategy)
        r = Breakdown(micro_batches=self.micro)
        mem = {"params": 0.0, "grads": 0.0, "optimizer": 0.0, "activations": 0.0}
        for layer, s in zip(g.layers, layers):
            n = self.node_terms(layer, s)
            r.compute_time += n["compute"]
            r.grad_sync_time += n["grad_time"]
            r.gather_time += n["gather_time"]
            r.grad_sync_bytes += n["grad_bytes"]
            r.forward_time += n["fwd_time"]
            r.forward_bytes += n["fwd_bytes"]
            r.backward_time += n["bwd_time"]
            r.backward_bytes += n["bwd_bytes"]
            for k in mem:
                mem[k] += n["memory"][k]
            r.per_layer[layer.name] = {"time": n["time"], "compute": n["compute"],
                                       "bytes": n["grad_bytes"] + n["fwd_bytes"] +
                                       n["bwd_bytes"], "memory": n["memory"]["total"]}
        for u, v in g.edges:
            e = self.edge_terms(g.layers[u], layers[u], g.layers[v], layers[v])
            r.forward_time += e["fwd_time"]
            r.forward_bytes += e["fwd_bytes"]
            r.backward_time += e["bwd_time"]
            r.backward_bytes += e["bwd_bytes"]
            pl = r.per_layer[g.layers[v].name]   # an edge is charged to its consumer
            pl["time"] += e["time"]
            pl["bytes"] += e["fwd_bytes"] + e["bwd_bytes"]
        mem["total"] = sum(mem.values())
        r.memory = mem
        r.time = (r.compute_time + r.forward_time + r.backward_time + r.grad_sync_time)
        return r


def evaluate(graph, strategy, cluster, micro_batches: int = 1) -> Breakdown:
    """The predicted time, bytes per device and memory per device of a one-stage
    ``strategy`` (`sbpflow.auto.pipeline_cost.evaluate`, which ``sf.auto.evaluate`` is, also takes
    pipelines)."""
    return Evaluator(graph, cluster, micro_batches).breakdown(strategy)
