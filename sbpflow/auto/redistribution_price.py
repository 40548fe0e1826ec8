"""The analytic price of a redistribution: the collectives it takes, mesh dim by mesh dim, in
a fixed order (running the boxing planner on placements of 1024 ranks would be far too slow
for a search), and their alpha-beta time; moves the fixed order cannot make (nested splits)
are priced as the planner's reduce-then-transfer. `evaluate.Evaluator` keeps the prices a
search asks for. See docs/auto.md, 'Evaluation' (the table, the order, and how the price
compares with the planner's).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from ..caches import BoundedDict, memoize
from ..cost.formulas import linear_time, volume
from ..layouts import MeshLayout, takes_mesh_layouts
from ..sbp import Partial, Split
from .transfer_loads import transfer_fraction
from .walk import TransferWalk, Walk, WalkMove, divisor, fine_walk, layout_code

__all__ = ["redistribution", "redistribution_steps", "redistribution_floor", "Move",
           "Collective", "common_refinement", "find_walk", "walk_price",
           "transfer_floor"]


@memoize(1 << 16)
def common_refinement(mesh_a: tuple, mesh_b: tuple):
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


@takes_mesh_layouts(1)
@memoize(1 << 20)
def redistribution_steps(shape: tuple, src: MeshLayout, dst: MeshLayout) -> tuple:
    """The collectives of the analytic redistribution of a tensor of ``shape`` from ``src``
    to ``dst`` (`MeshLayout` s or ``(mesh, nd-sbp)`` pairs; the old form ``(shape, src_mesh,
    src, dst_mesh, dst)`` works one release): `Collective` records ``(kind, fine_mesh, dims,
    numel)`` where ``numel`` is the size of the piece each collective is about (for a
    ``"transfer"``: the elements the busiest rank receives)."""
    (sm, s), (dm, d) = src, dst
    return tuple(Collective(*m[:4]) for m in _plan(tuple(shape), tuple(sm), tuple(s),
                                                   tuple(dm), tuple(d))
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
    it is found once per number of axes (`find_walk`) and sized here."""
    return _sized_walk(find_walk(len(shape), tuple(src_mesh), tuple(src), tuple(dst_mesh),
                                 tuple(dst)), shape)


def _sized_walk(walk: Walk, shape: tuple) -> tuple:
    """The `Move` s of ``walk`` for a tensor of ``shape``."""
    if walk.how == "moves":
        return tuple(_sized(m, shape) for m in walk.body)
    return _via_transfer(shape, walk.body)


@memoize(1 << 20)
def find_walk(ndim: int, src_mesh: tuple, src: tuple, dst_mesh: tuple, dst: tuple) -> Walk:
    """The `Walk`: ``("moves", WalkMove s)`` or ``("transfer", `TransferWalk`)``, for any shape of
    ``ndim`` axes (`_plan`). It depends on the meshes and layouts only through their common
    refinement (`_fine_skeleton`): an (8, 8) mesh meeting a (64,) one walks the same (8, 8)
    layouts as two (8, 8) meshes do."""
    if src_mesh == dst_mesh and src == dst:
        return Walk("moves", ())
    ref = common_refinement(src_mesh, dst_mesh)
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


# `find_walk` of the layouts ``s`` -> ``d`` on the refined mesh ``fine``
_fine_skeleton = memoize(1 << 20,
                         name="sbpflow.auto.redistribution_price._fine_skeleton")(fine_walk)


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


@takes_mesh_layouts(1)
def redistribution(shape, src: MeshLayout, dst: MeshLayout, itemsize: int = 4, cluster=None,
                   micro_batches: int = 1) -> tuple[float, float]:
    """(seconds, bytes sent per device) of redistributing a tensor of ``shape`` from layout
    ``src`` to ``dst`` (`MeshLayout` s or ``(mesh, nd-sbp)`` pairs; the old form ``(shape,
    src_mesh, src, dst_mesh, dst, ...)`` works one release, with a DeprecationWarning);
    seconds need a ``cluster``. With micro-batches the activation moves in ``micro_batches``
    pieces (same bytes, more latency).

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
    (sm, s), (dm, d) = src, dst
    return walk_price(find_walk(len(shape), tuple(sm), tuple(s), tuple(dm), tuple(d)),
                      tuple(shape), itemsize, cluster, micro_batches)


def walk_price(walk: Walk, shape: tuple, itemsize: int, cluster,
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


@takes_mesh_layouts(1)
def redistribution_floor(shape, src: MeshLayout, dst: MeshLayout, itemsize: int, cluster,
                         micro_batches: int = 1) -> float | None:
    """None when the redistribution is the fixed order's moves, whose price is cheap once
    the walk is known (price it instead); else a lower bound of ``redistribution(...)[0]``
    (seconds) found from the walk alone, before any receiver's load is: the least over the
    planner's reduce-then-transfer options of the reduction's price plus the transfer's
    price for rank 0's load (rank 0, at coordinate 0 of the mesh, receives no more elements
    than the busiest receiver, and at least one message), at the mesh's p2p fit, the one
    the price uses (inter-node for a mesh across nodes, so this is far above
    `edge_lower_bounds`' least link). The price's terms, added in its order, each at most
    the price's; scaled by ``1 - 1e-9`` like the dense bounds. Layouts as `redistribution`."""
    (sm, s), (dm, d) = src, dst
    walk = find_walk(len(shape), tuple(sm), tuple(s), tuple(dm), tuple(d))
    if walk.how != "transfer":
        return None
    return transfer_floor(walk.body, shape, itemsize, cluster, micro_batches)


def transfer_floor(sk: TransferWalk, shape: tuple, itemsize: int, cluster,
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
