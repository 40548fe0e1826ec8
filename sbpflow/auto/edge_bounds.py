"""Lower bounds of edge times, a dense matrix per edge table (`edge_lower_bounds`): what rank
0, and node 0, must receive between a producer's and a consumer's layouts, at the least price
a byte and a move can have on the cluster. The search skips entries by these bounds, so each
must stay below the analytic price (`redistribution_price`); tests/auto/test_edge_bounds.py
compares them over every table. See docs/auto.md, 'How the search works'.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from ..caches import BoundedDict
from ..sbp import Broadcast, Partial, Split
from .redistribution_price import common_refinement
from .walk import TRANSFER_MAX_RANKS

__all__ = ["edge_lower_bounds"]


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
    ref = np.array([[common_refinement(a, b) is not None for b in dst.meshes] for a in src.meshes])
    if ref.all():
        return with_node
    rank = _bound_matrix(src, dst, beta, 0.0, nbytes, lat, part)[pick]
    return np.where(ref[np.ix_(src.mesh_of, dst.mesh_of)], with_node, rank)
