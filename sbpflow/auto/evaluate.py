"""Cost of a strategy: alpha-beta time of every redistribution, weight-gradient sync, compute,
and memory per device.

Redistribution is priced analytically, mesh dim by mesh dim (running the boxing planner on
placements of 1024 ranks would be far too slow for a search):

=============  ===============  ==========================================================
src -> dst     collective       group / bytes the collective is about
=============  ===============  ==========================================================
S -> B         all_gather       ranks along the dim; the gathered piece
P -> B         all_reduce       ranks along the dim; the piece
P -> S         reduce_scatter   ranks along the dim; the piece before scattering
S(i) -> S(j)   all_to_all       ranks along the dim; the piece
B -> S, B -> P, S -> P          local, free
=============  ===============  ==========================================================

"The piece" is the tensor divided by the split factors of the other mesh dims at that moment.
Steps run in the order that keeps pieces small: free slices, reduce-scatters, all-to-alls,
all-reduces, all-gathers; dims of the same kind in one phase merge into one collective over
their joint group (as the boxing planner does). Source and destination may use different
meshes over the same ranks: both are refined to their common row-major refinement (e.g.
(4, 256) and (32, 32) -> (4, 8, 32)); meshes with no common refinement (e.g. (3, 4) and
(4, 3)) are priced as an all-to-all of the whole tensor over all ranks, an upper bound.
A group's link is intra- or inter-node as the cluster says for its ranks (mesh dims cover
ranks node-major). For one changed mesh dim whose tensor axis no later dim also splits the
bytes equal the boxing planner's exactly (tested), except a P source next to B or other P
dims, where the planner may use the replicas / partial dims (slice, reduce-scatter,
all-gather) and the price here is an upper bound; with several changed dims it is the cost of this fixed order, an upper
bound on the planner's least-bytes path (tested on 4 and 8 ranks, layouts without nested
splits). When a move of the fixed order is not a valid boxing step because two mesh dims split
the same tensor axis (nested splits, also created by refining meshes), the redistribution is
priced as the planner performs it: partial dims reduced on the source devices (all-reduce or
reduce-scatter, the choice that moves fewest bytes), then a point-to-point ``"transfer"`` in
which every rank receives the part of its destination box it does not hold, one message per
overlapping source region (on meshes of up to 256 ranks; above that each such move is priced as
the collective the fixed order would use, an estimate that keeps a search fast). Where the planner finds a chain of collectives
moving no more bytes than that transfer it takes the chain instead, and this price is then an
estimate (tested equal to the planner's on the transfers it builds). Seconds also include
local copies through strided views and a per-step software cost when the cluster has them
(`redistribution`).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from ..boxing.steps import is_local_change, is_valid_move
from ..cost.formulas import volume
from ..sbp import B, Broadcast, Partial, S, Split, dual_nd

__all__ = ["Breakdown", "Evaluator", "evaluate", "redistribution", "redistribution_steps"]


# ---- analytic redistribution -------------------------------------------------------------------
@lru_cache(maxsize=1 << 16)
def _refine(mesh_a: tuple, mesh_b: tuple):
    """Common row-major refinement: (fine mesh, fine->coarse index for a, for b) or None."""
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


@lru_cache(maxsize=1 << 18)
def redistribution_steps(shape: tuple, src_mesh: tuple, src: tuple, dst_mesh: tuple,
                         dst: tuple) -> tuple:
    """The collectives of the analytic redistribution: ``((kind, fine_mesh, dims, numel), ...)``
    where ``numel`` is the size of the piece each collective is about (for a ``"transfer"``:
    the elements the busiest rank receives)."""
    return tuple(r[:4] for r in _plan(tuple(shape), tuple(src_mesh), tuple(src),
                                      tuple(dst_mesh), tuple(dst)) if r[0] != "local")


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


def _reduced_first(s: list, d: list, ndim: int) -> list:
    """``d`` with every dim whose change is not a local one between two partials (``P(sum) ->
    P(max)``: `sbpflow.boxing.steps.is_local_change`) made a split of an axis no dim splits
    (else axis 0): such a dim is reduce-scattered first, as the planner does, and the split
    turns partial locally at the end."""
    used = {x.axis for x in s + d if isinstance(x, Split)}
    free = [a for a in range(ndim) if a not in used]
    out = list(d)
    for j, (a, b) in enumerate(zip(s, d)):
        if isinstance(a, Partial) and isinstance(b, Partial) and not is_local_change(a, b):
            out[j] = S(free.pop(0) if free else 0)
    return out


_TRANSFER_MAX_RANKS = 256


def _boxes(fine: tuple, nd: tuple, ndim: int) -> tuple[np.ndarray, np.ndarray]:
    """``(lo, hi)``, each ``[rank, axis]``: the fraction ``[lo, hi)`` of every tensor axis the
    rank at each mesh coordinate (row-major) holds under ``nd`` (even splits)."""
    coords = np.array(list(itertools.product(*[range(m) for m in fine])), dtype=np.float64)
    lo = np.zeros((len(coords), ndim))
    hi = np.ones((len(coords), ndim))
    for d, (x, m) in enumerate(zip(nd, fine)):
        if isinstance(x, Split):
            w = (hi[:, x.axis] - lo[:, x.axis]) / m
            lo[:, x.axis] += coords[:, d] * w
            hi[:, x.axis] = lo[:, x.axis] + w
    return lo, hi


def _transfer(shape: tuple, fine: tuple, src: tuple, dst: tuple):
    """What the receivers get when a partial-free ``src`` layout is sent point to point into
    ``dst`` (the boxing planner's transfer step): a rank receives the part of its destination
    box it does not hold, one message from each rank whose source box overlaps it (one holder
    per distinct source region); a non-first rank of a ``P(sum)`` destination dim receives
    nothing (it holds zeros; a ``P(max)`` / ``P(min)`` one holds a copy, so it does receive). Returns ``(elements, loads)``: the most elements a rank
    receives, and the ``(elements, messages)`` of every receiver not dominated by another (the
    busiest in time is one of them, whatever alpha and beta are). None on meshes of more than
    ``_TRANSFER_MAX_RANKS`` ranks (too many boxes to enumerate in a search)."""
    t = _transfer_fraction(fine, src, dst, len(shape))
    if t is None:
        return None
    n = math.prod(shape)
    return max((f for f, _ in t), default=0.0) * n, tuple((f * n, m) for f, m in t)


@lru_cache(maxsize=1 << 16)
def _transfer_fraction(fine: tuple, src: tuple, dst: tuple, ndim: int):
    """`_transfer`'s loads as fractions of the tensor (they depend on the shape only through
    that). The distinct source boxes tile the tensor as a grid, the product over axes of
    each axis's equal parts (as many as the product of the mesh dims splitting it), so for a
    receiver whose destination box is ``want`` and own source box ``have``: the elements it
    lacks are ``|want| - |want ∩ have|`` and its messages are the grid cells ``want`` meets,
    less its own cell if ``want`` meets it; both factor over axes. Every rank at once, as
    arrays."""
    if math.prod(fine) > _TRANSFER_MAX_RANKS:
        return None
    slo, shi = _boxes(fine, src, ndim)
    dlo, dhi = _boxes(fine, dst, ndim)
    parts = np.ones(ndim)
    for x, m in zip(src, fine):
        if isinstance(x, Split):
            parts[x.axis] *= m
    eps = 1e-9
    # per rank and axis: the source cells the destination interval meets
    first = np.floor(dlo * parts + eps)
    last = np.ceil(dhi * parts - eps)
    cells = np.maximum(last - first, 0.0).prod(axis=1)
    inter = np.clip(np.minimum(dhi, shi) - np.maximum(dlo, slo), 0.0, None)
    meets_own = (inter > eps / parts).all(axis=1)
    elems = (dhi - dlo).prod(axis=1) - inter.prod(axis=1)
    msgs = cells - meets_own
    receives = np.ones(len(slo), dtype=bool)   # a non-first rank of a P(sum) dim holds zeros
    coords = np.array(list(itertools.product(*[range(m) for m in fine])))
    for d, x in enumerate(dst):
        if isinstance(x, Partial) and x.op == "sum":
            receives &= coords[:, d] == 0
    need = receives & (elems > 1e-12)
    # the Pareto front of (elements, messages), elements compared to rounding
    loads = sorted({(round(float(e), 12), int(round(m))) for e, m in zip(elems[need],
                                                                           msgs[need])})
    front: list = []
    for e, m in reversed(loads):          # most elements first
        if not front or m > front[-1][1]:
            front.append((e, m))
    return tuple(front)


@lru_cache(maxsize=1 << 18)
def _plan(shape: tuple, src_mesh: tuple, src: tuple, dst_mesh: tuple, dst: tuple) -> tuple:
    """`redistribution_steps` with two more fields a record: ``copy`` (elements a rank copies
    to cut non-contiguous pieces) and ``loads`` (transfers only: the receivers' ``(elements,
    messages)`` of `_transfer`)."""
    steps = _fixed_order(shape, src_mesh, src, dst_mesh, dst)
    if not any(r[0] == "nested" for r in steps):
        return steps
    # A move of the fixed order is not a valid boxing step (nested splits of one axis): the
    # planner reduces partial dims on the source devices, then sends each rank what it lacks.
    fine = steps[0][1]
    ref = _refine(tuple(src_mesh), tuple(dst_mesh))
    _, oa, ob = ref
    s = tuple(src[i] for i in oa)
    d = tuple(dst[i] for i in ob)
    pdims = tuple(j for j, x in enumerate(s) if isinstance(x, Partial))
    numel = math.prod(shape)
    best = None
    mids = [s] if not pdims else \
        [tuple(B if j in pdims else x for j, x in enumerate(s))] + \
        [tuple(S(a) if j in pdims else x for j, x in enumerate(s)) for a in range(len(shape))]
    for mid in mids:
        pre = []
        if pdims:
            kind = "all_reduce" if mid[pdims[0]] == B else "reduce_scatter"
            if kind == "reduce_scatter" and not is_valid_move(s, mid, pdims):
                continue
            local = _local_shape(shape, fine, s)
            ax = mid[pdims[0]].axis if kind == "reduce_scatter" else 0
            copy = math.prod(local) if kind == "reduce_scatter" and _strided(local, ax) else 0.0
            pre.append((kind, fine, pdims, _piece(numel, fine, s, set(pdims)), copy, 0))
        t = _transfer(shape, fine, mid, d)
        if t is None:  # too many ranks to enumerate: each move priced as its own collective
            return tuple(r if r[0] != "nested" else (r[5],) + r[1:5] + (0,) for r in steps)
        elems, loads = t
        rec = pre + ([("transfer", fine, tuple(range(len(fine))), elems, 0.0, loads)]
                     if loads else [])
        # the planner's choice: fewest bytes (per device here)
        vol = sum(r[3] if r[0] == "transfer" else
                  _per_device(r[0], r[3], math.prod(fine[j] for j in r[2])) for r in rec)
        if best is None or vol < best[0]:
            best = (vol, tuple(rec))
    return best[1]


def _fixed_order(shape: tuple, src_mesh: tuple, src: tuple, dst_mesh: tuple,
                 dst: tuple) -> tuple:
    """The fixed-order collectives (module doc); a move the planner could not make as one step
    (nested splits) is marked ``"nested"``."""
    numel = math.prod(shape)
    if src_mesh == dst_mesh and src == dst:
        return ()
    ref = _refine(tuple(src_mesh), tuple(dst_mesh))
    if ref is None:  # incompatible meshes: reduce partials, then everything to everyone
        steps, st = [], list(src)
        pdims = tuple(j for j, s in enumerate(src) if isinstance(s, Partial))
        if pdims:
            steps.append(("reduce_scatter", tuple(src_mesh), pdims,
                          _piece(numel, src_mesh, st, set(pdims))))
        world = (math.prod(src_mesh),)
        steps.append(("all_to_all", world, (0,), numel))
        return tuple(r + (0.0, 0) for r in steps)
    fine, oa, ob = ref
    s = [src[i] for i in oa]
    final = [dst[i] for i in ob]
    d = _reduced_first(s, final, len(shape))   # the target until the last local phase
    state = list(s)
    # a move can only be invalid if some tensor axis is split on two different dims (in the
    # source or the destination): otherwise skip the checks (the common, fast case)
    split_dims: dict = {}
    for j, x in enumerate(s + d):
        if isinstance(x, Split):
            split_dims.setdefault(x.axis, set()).add(j % len(fine))
    nested = any(len(v) > 1 for v in split_dims.values())
    steps = []

    def phase(kind, test):
        dims = tuple(j for j in range(len(fine)) if test(state[j], d[j]))
        if not dims:
            return
        if nested:
            new = list(state)
            for j in dims:
                new[j] = d[j]
            if not is_valid_move(state, new, dims):
                # the last field: the collective the move would be (a local slice whose part
                # is held by others: an all-to-all), the price of last resort (`_plan`)
                steps.append(("nested", fine, dims, _piece(numel, fine, state, set(dims)),
                              0.0, kind or "all_to_all"))
                state[:] = new
                return
        if kind is None:
            steps.append(("local", fine, dims, 0.0, 0.0, 0))
        else:
            piece = _piece(numel, fine, state, set(dims))
            copy = 0.0
            if kind in ("reduce_scatter", "all_to_all"):
                g = math.prod(fine[j] for j in dims)
                # the pieces are cut along the destination split of the local input
                local = _local_shape(shape, fine, state)
                if any(_strided(local, d[j].axis) for j in dims):
                    copy += piece if kind == "reduce_scatter" else piece / g
                if kind == "all_to_all":
                    # received pieces are written along the source split of the local output
                    out = list(state)
                    for j in dims:
                        out[j] = d[j]
                    local = _local_shape(shape, fine, out)
                    if any(_strided(local, state[j].axis) for j in dims):
                        copy += piece / g
            steps.append((kind, fine, dims, piece, copy, 0))
        for j in dims:
            state[j] = d[j]

    # B -> S / P is a local slice, unless a later dim splits the same axis: then the slice a
    # rank needs is mostly held by others (priced as an all-to-all over those dims: estimate)
    def later_split(j, axis):
        return tuple(k for k in range(j + 1, len(fine))
                     if isinstance(state[k], Split) and state[k].axis == axis)
    moved = set()
    for j in range(len(fine)):
        if isinstance(state[j], Broadcast) and isinstance(d[j], Split) and \
                later_split(j, d[j].axis) and j not in moved:
            dims = (j,) + tuple(k for k in later_split(j, d[j].axis) if k not in moved)
            steps.append(("nested", fine, dims, _piece(numel, fine, state, set(dims)), 0.0,
                          "all_to_all"))
            moved.update(dims)
    for j in moved:
        if isinstance(state[j], Broadcast):
            state[j] = d[j]
    phase(None, lambda a, b: isinstance(a, Broadcast) and a != b)
    phase("reduce_scatter", lambda a, b: isinstance(a, Partial) and isinstance(b, Split))
    phase("all_to_all", lambda a, b: isinstance(a, Split) and isinstance(b, Split) and a != b)
    phase("all_reduce", lambda a, b: isinstance(a, Partial) and isinstance(b, Broadcast))
    # an all-gather is about the gathered piece: the other dims already in their final state
    dims = tuple(j for j in range(len(fine)) if isinstance(state[j], Split) and
                 isinstance(d[j], Broadcast))
    if dims:
        new = list(state)
        for j in dims:
            new[j] = d[j]
        valid = not nested or is_valid_move(state, new, dims)
        # the gathered pieces are written along the source split axes of the local output
        strided = any(_strided(_local_shape(shape, fine, new), state[j].axis) for j in dims)
        state[:] = new
        piece = _piece(numel, fine, state, set(dims))
        steps.append(("all_gather", fine, dims, piece, piece if strided else 0.0, 0)
                     if valid else ("nested", fine, dims, piece, 0.0, "all_gather"))
    d[:] = final
    phase(None, lambda a, b: a != b)  # S -> P: local
    return tuple(steps)


@lru_cache(maxsize=1 << 14)
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
    t = b = 0.0
    for kind, fine, dims, numel, copy, msgs in _plan(tuple(shape), tuple(src_mesh), tuple(src),
                                                     tuple(dst_mesh), tuple(dst)):
        if cluster is not None:
            t += micro_batches * cluster.step_overhead
        if kind == "local":
            continue
        g = math.prod(fine[j] for j in dims)
        nbytes = numel * itemsize
        if kind == "transfer":
            b += nbytes
            if cluster is not None:
                t += micro_batches * max(
                    _transfer_time(cluster, e * itemsize / micro_batches, m, fine)
                    for e, m in msgs)
            continue
        b += _per_device(kind, nbytes, g)
        if cluster is not None:
            n = _about(kind, nbytes, g)
            t += micro_batches * _coll_time(cluster, kind, n / micro_batches, fine, dims)
            if copy:
                t += cluster.copy_time(copy * itemsize)
    return t, b


def _transfer_time(cluster, nbytes, msgs, fine):
    """A point-to-point transfer in which the busiest rank receives ``nbytes`` in ``msgs``
    messages: ``o + msgs·α + nbytes·β`` (plus ``copy_beta·nbytes``: the pieces are written
    into the receiver's output shard) with the p2p parameters of the whole mesh's link class
    (`Cluster.fit`; ``o`` = 0 without a per-kind fit). An estimate of what
    `sbpflow.cost.step_time` gives the planner's transfer step: that one prices each message
    on the link of its own pair and takes the larger of a rank's sends and receives (equal on
    one node, when every rank receives at least what it sends)."""
    ranks = _group_ranks(fine, tuple(range(len(fine))))
    return cluster.fit("p2p", ranks[:1] + ranks[-1:]).time(msgs, nbytes) + \
        cluster.copy_time(nbytes)


_TIME_CACHE: dict = {}


def _coll_time(cluster, kind, nbytes, fine, dims):
    """Time of one collective over the group of ``dims`` of the fine mesh that holds rank 0
    (groups along a dim are translates of it, so they cross node boundaries alike when the
    mesh dims align with nodes; they do for meshes whose dims are divisors in row-major)."""
    entry = _TIME_CACHE.get(id(cluster))
    if entry is None or entry[0] is not cluster:
        if len(_TIME_CACHE) > 64:
            _TIME_CACHE.clear()
        entry = _TIME_CACHE[id(cluster)] = (cluster, {})   # holds the cluster: ids stay unique
    cache = entry[1]
    key = (kind, nbytes, fine, dims)
    t = cache.get(key)
    if t is None:
        ranks = list(_group_ranks(fine, dims))
        t = cache[key] = float(cluster.collective_time(kind, nbytes, ranks))
    return t


# ---- per-layer and per-edge terms --------------------------------------------------------------
def _local_numel(shape, mesh, nd):
    n = math.prod(shape)
    for s, m in zip(nd, mesh):
        if isinstance(s, Split):
            n /= m
    return n


def _to_ndim(nd, ndim):
    return tuple(S(min(s.axis, ndim - 1)) if isinstance(s, Split) else s for s in nd)


@dataclass
class Breakdown:
    """Predicted cost of one strategy (times in seconds, bytes per device)."""

    time: float = 0.0
    compute_time: float = 0.0
    forward_time: float = 0.0      # activation redistributions, forward
    backward_time: float = 0.0     # activation-gradient redistributions, backward
    grad_sync_time: float = 0.0    # weight-gradient sync (and ZeRO weight gathers)
    forward_bytes: float = 0.0
    backward_bytes: float = 0.0
    grad_sync_bytes: float = 0.0
    memory: dict = field(default_factory=dict)   # params, grads, optimizer, activations, total
    per_layer: dict = field(default_factory=dict)
    micro_batches: int = 1

    @property
    def comm_time(self) -> float:
        return self.forward_time + self.backward_time + self.grad_sync_time

    @property
    def bytes(self) -> float:
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
                f"{m.get('total', 0) / gb:.2f} GiB (micro-batches {self.micro_batches})")


class Evaluator:
    """Per-layer and per-edge cost terms for one (graph, cluster), cached. The cost of a
    strategy is the sum of ``node`` over layers and ``edge`` over the graph's edges."""

    def __init__(self, graph, cluster, micro_batches: int = 1):
        self.graph, self.cluster, self.micro = graph, cluster, int(micro_batches)
        self.itemsize = graph.itemsize
        self._node: dict = {}
        self._edge: dict = {}

    def _redist(self, shape, a_mesh, a, b_mesh, b, micro=1):
        return redistribution(shape, a_mesh, a, b_mesh, b, self.itemsize, self.cluster, micro)

    def node_terms(self, layer, s) -> dict:
        """compute, grad-sync (time, bytes), sink reduction (fwd/bwd), memory of one layer."""
        idx = self.graph.index.get(layer.name)
        sink = idx is not None and not self.graph.succs[idx]
        key = (layer.key, s, sink)
        hit = self._node.get(key)
        if hit is not None:
            return hit
        mesh, it, m = s.mesh, self.itemsize, self.micro
        work = 1
        for d, size in enumerate(mesh):
            rep = s.input[d] == B and s.output[d] == B and (s.weight is None or s.weight[d] == B)
            work *= 1 if rep else size
        fl = getattr(self.cluster, "flops_per_device", None)
        compute = 3.0 * layer.flops / work / fl if fl else 0.0
        gt = gb = 0.0
        mem = {"params": 0.0, "grads": 0.0, "optimizer": 0.0, "activations": 0.0}
        if layer.weight_shape is not None:
            w, st, ws = s.weight, s.weight_stored, tuple(layer.weight_shape)
            t, b = self._redist(ws, mesh, dual_nd(w), mesh, st)   # gradient -> param layout
            gt, gb = gt + t, gb + b
            if st != w:  # ZeRO: gather the weight for forward and again for backward
                t, b = self._redist(ws, mesh, st, mesh, w)
                gt, gb = gt + 2 * m * t, gb + 2 * m * b
            n = _local_numel(ws, mesh, st)
            mem["params"] = mem["grads"] = n * it
            mem["optimizer"] = n * 4 * self.graph.optimizer_states
        mem["activations"] = (_local_numel(layer.input_shape, mesh, s.input) +
                              _local_numel(layer.output_shape, mesh, s.output)) * it / m
        ft = fb = bt = bb = 0.0
        if sink:
            if any(isinstance(x, Partial) for x in s.output):  # the loss needs a full value
                red = tuple(S(0) if isinstance(x, Partial) else x for x in s.output)
                ft, fb = self._redist(layer.output_shape, mesh, s.output, mesh, red, m)
                bt, bb = self._redist(layer.output_shape, mesh, dual_nd(red), mesh,
                                      dual_nd(s.output), m)
        mem["total"] = sum(mem.values())
        out = {"compute": compute, "grad_time": gt, "grad_bytes": gb, "fwd_time": ft,
               "fwd_bytes": fb, "bwd_time": bt, "bwd_bytes": bb, "memory": mem,
               "time": compute + gt + ft + bt}
        self._node[key] = out
        return out

    def edge_terms(self, producer, a, consumer, b) -> dict:
        """Forward redistribution of the producer's output into the consumer's input layout
        and the dual redistribution of its gradient in backward."""
        shape = tuple(producer.output_shape)
        b_in = _to_ndim(b.input, len(shape))
        key = (shape, a.mesh, a.output, b.mesh, b_in)
        hit = self._edge.get(key)
        if hit is not None:
            return hit
        ft, fb = self._redist(shape, a.mesh, a.output, b.mesh, b_in, self.micro)
        if any(isinstance(x, Partial) and x.op != "sum" for x in b_in + a.output):
            bt = bb = 0.0
        else:
            bt, bb = self._redist(shape, b.mesh, dual_nd(b_in), a.mesh, dual_nd(a.output),
                                  self.micro)
        out = {"fwd_time": ft, "fwd_bytes": fb, "bwd_time": bt, "bwd_bytes": bb,
               "time": ft + bt}
        self._edge[key] = out
        return out

    def breakdown(self, strategy) -> Breakdown:
        g = self.graph
        layers = strategy.layers if hasattr(strategy, "layers") else list(strategy)
        r = Breakdown(micro_batches=self.micro)
        mem = {"params": 0.0, "grads": 0.0, "optimizer": 0.0, "activations": 0.0}
        for layer, s in zip(g.layers, layers):
            n = self.node_terms(layer, s)
            r.compute_time += n["compute"]
            r.grad_sync_time += n["grad_time"]
            r.grad_sync_bytes += n["grad_bytes"]
            r.forward_time += n["fwd_time"]
            r.forward_bytes += n["fwd_bytes"]
            r.backward_time += n["bwd_time"]
            r.backward_bytes += n["bwd_bytes"]
            for k in mem:
                mem[k] += n["memory"][k]
            r.per_layer[layer.name] = {"time": n["time"], "bytes": n["grad_bytes"] +
                                       n["fwd_bytes"] + n["bwd_bytes"],
                                       "memory": n["memory"]["total"]}
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
    """The predicted time, bytes per device and memory per device of ``strategy``."""
    return Evaluator(graph, cluster, micro_batches).breakdown(strategy)
