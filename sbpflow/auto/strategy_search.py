"""Search algorithms over the strategy space.

The cost of a strategy is a sum of per-layer terms and edge terms (redistributions); `Problem`
keeps the edge terms in tables over the distinct layouts, filled on demand and shared by
repeated layers. Algorithms: ``"cd"`` coordinate descent with path moves and restarts
(default), ``"mh"`` Metropolis-Hastings, ``"random"``, ``"exhaustive"`` (exact dynamic
programming over an in-tree of layers, min-plus products that skip entries which cannot lower
a minimum) and ``"enumerate"``. A memory limit is a penalty (a Lagrangian price in the DP).
See docs/auto.md, 'How the search works'.
"""

from __future__ import annotations

import itertools
import math
import numbers
import random
import time
from dataclasses import dataclass, field

import numpy as np

from ..caches import collector_paused
from ..errors import CostError
from .checks import check_search
from .evaluate import Breakdown, Evaluator, edge_lower_bounds
from .space import (Strategy, _clip_axis, check_whole_sequences, layer_space,
                    tie_agreement, weight_layout, whole_sequences)

__all__ = ["SearchResult", "one_stage_search", "Problem", "PENALTY"]

PENALTY = 1e4


@dataclass
class SearchResult:
    strategy: Strategy
    breakdown: Breakdown
    trace: list = field(default_factory=list)   # (seconds since start, best objective)
    algorithm: str = ""
    cost: float = 0.0                           # objective (= time when memory fits)
    seconds: float = 0.0
    evaluations: int = 0
    micro_batches: int = 1
    memory_limit: float | None = None
    edge_evaluations: int = 0                   # edge-cost table entries computed (the work)

    @property
    def fits(self) -> bool:
        """The strategy's memory per device is within the limit."""
        return self.memory_limit is None or self.breakdown.memory["total"] <= self.memory_limit

    def __str__(self) -> str:
        return (f"{self.algorithm}: cost {self.cost * 1e3:.3f} ms in {self.seconds:.2f} s "
                f"({self.evaluations} evaluations)\n{self.breakdown}\n{self.strategy.table()}")


class _EdgeTable:
    """Edge times between one producer's candidates and one consumer's, filled on demand.

    An edge is a redistribution of the producer's output into the consumer's input layout, so
    its time depends on the two strategies only through (mesh, output layout) of the producer
    -- a row -- and (mesh, input layout) of the consumer -- a column. The table holds the
    distinct rows x distinct columns of a tensor shape; edges with the same shape, rows and
    columns share one table (`Problem`), so the 96 blocks of a GPT fill it once, and so do
    edges between different layers with equal layouts (GPT-3's proj -> fc1, fc2 -> qkv and
    fc2 -> head). Unknown entries hold ``inf``."""

    def __init__(self, pb: "Problem", shape: tuple, rows: list, cols: list):
        self.pb, self.shape = pb, shape
        self.rows, self.cols = rows, cols        # (mesh, output) / (mesh, clipped input)
        index = {k: i for i, k in enumerate(rows)}
        # the row whose output layout is this column's input layout (usually a free edge)
        self.match = np.array([index.get(k, -1) for k in cols], dtype=np.int64)
        self.M = np.full((len(rows), len(cols)), np.inf)
        self.known = np.zeros(self.M.shape, dtype=bool)
        # forward times found ahead of the backward ones (`fill_forward`)
        self.Mf = np.full(self.M.shape, np.nan)
        self.fwd_known = np.zeros(self.M.shape, dtype=bool)
        # the entries whose bounds were raised by their walks' floors (`raise_floors`)
        self.floored_fwd = np.zeros(self.M.shape, dtype=bool)
        self.floored_bwd = np.zeros(self.M.shape, dtype=bool)
        self._lower = self._lower_bwd = self._lower_fwd = None

    @property
    def lower(self) -> np.ndarray:
        """A lower bound of every entry (`sbpflow.auto.evaluate.edge_lower_bounds`), below
        the exact value by at least a relative 1e-9: cheap, dense, computed once, then
        raised entry by entry to the walks' floors (`raise_floors`)."""
        if self._lower is None:
            ev = self.pb.ev
            self._lower = edge_lower_bounds(self.shape, ev.itemsize, ev.cluster, self.rows,
                                            self.cols, ev.micro)
        return self._lower

    @property
    def lower_bwd(self) -> np.ndarray:
        """A lower bound of every entry's backward part (`Evaluator.edge_backward`)."""
        if self._lower_bwd is None:
            self._lower_bwd = self._part_bounds("backward")
        return self._lower_bwd

    @property
    def lower_fwd(self) -> np.ndarray:
        """A lower bound of every entry's forward part (`Evaluator.edge_forward`)."""
        if self._lower_fwd is None:
            self._lower_fwd = self._part_bounds("forward")
        return self._lower_fwd

    def _part_bounds(self, part: str) -> np.ndarray:
        ev = self.pb.ev
        return edge_lower_bounds(self.shape, ev.itemsize, ev.cluster, self.rows, self.cols,
                                 ev.micro, part=part)

    def raise_floors(self, r: np.ndarray, c: np.ndarray, part: str) -> None:
        """Raise the ``part`` (``"forward"`` or ``"backward"``) bound and ``lower`` of the
        unknown entries among the pairs (r[k], c[k]) to what the walk of that direction gives
        (`Evaluator.edge_forward_floor`: the fixed order's moves priced, a transfer bounded at
        the mesh's own link, often ten times the least one the dense bound must assume); a
        forward price so found is kept (`fill_forward`'s). A walk costs a fraction of a
        transfer's price and is kept for it, so an entry ruled out here is never priced, and
        one that is not has lost little."""
        backward = part == "backward"
        done = self.floored_bwd if backward else self.floored_fwd
        r, c = self._todo(r, c, self.known, done)
        if not len(r):
            return
        done[r, c] = True
        ev, shape, rows, cols = self.pb.ev, self.shape, self.rows, self.cols
        floor = ev.edge_backward_floor if backward else ev.edge_forward_floor
        got = [floor(shape, *rows[i], *cols[j]) for i, j in zip(r.tolist(), c.tolist())]
        secs = np.array([t for t, _ in got])
        exact = np.array([e for _, e in got], dtype=bool)
        if secs.min() < 0:
            self.pb.nonnegative = False
        if not backward:
            self.Mf[r[exact], c[exact]] = secs[exact]
            self.fwd_known[r[exact], c[exact]] = True
        fwd, bwd = self.lower_fwd, self.lower_bwd
        side = bwd if backward else fwd
        side[r, c] = np.maximum(side[r, c], np.where(exact, secs * (1 - 1e-9), secs))
        self._lower[r, c] = np.maximum(self.lower[r, c], fwd[r, c] + bwd[r, c])

    def survivors(self, r: np.ndarray, c: np.ndarray, keep, price: bool = True) -> np.ndarray:
        """The positions k of the pairs (r[k], c[k]) that ``keep(k, bound)`` (a bool per
        position) accepts at each bound, cheapest first: the walks' floors forward, then
        backward (`raise_floors`, read in ``lower``), then with ``price`` the forward part
        priced (`forward_bound`). A pair ruled out at one bound is not carried to the next,
        so the dearer bound's work is not done for it."""
        k = np.arange(len(r))
        for part in ("forward", "backward") + (("price",) if price else ()):
            rr, cc = r[k], c[k]
            if part == "price":
                bound = self.forward_bound(rr, cc)
            else:
                self.raise_floors(rr, cc, part)
                bound = self.lower[rr, cc]
            k = k[keep(k, bound)]
        return k

    def _todo(self, r, c, *known: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The distinct pairs (r[k], c[k]) marked in none of the ``known`` masks (read at
        the pairs only: a table's masks are far larger than a call's pairs)."""
        r, c = np.asarray(r, dtype=np.int64), np.asarray(c, dtype=np.int64)
        todo = ~known[0][r, c]
        for mask in known[1:]:
            todo &= ~mask[r, c]
        flat = np.sort(r[todo] * self.M.shape[1] + c[todo])
        if len(flat) > 1:   # np.unique's values, without its general path's overhead
            flat = flat[np.concatenate(([True], flat[1:] != flat[:-1]))]
        return np.divmod(flat, self.M.shape[1])

    def fill_forward(self, r: np.ndarray, c: np.ndarray) -> None:
        """Compute the forward part of the unknown entries among the pairs (r[k], c[k]) (an
        entry whose forward part already rules it out need not pay for its backward)."""
        r, c = self._todo(r, c, self.known, self.fwd_known)
        if not len(r):
            return
        ev, shape, rows, cols = self.pb.ev, self.shape, self.rows, self.cols
        pairs = [(rows[i], cols[j]) for i, j in zip(r.tolist(), c.tolist())]
        ev.find_loads(shape, pairs, [True] * len(pairs), backward=False)
        vals = np.array([ev.edge_forward(shape, *a, *b) for a, b in pairs])
        self.Mf[r, c] = vals
        self.fwd_known[r, c] = True
        if vals.min() < 0:
            self.pb.nonnegative = False

    def forward_bound(self, r: np.ndarray, c: np.ndarray) -> np.ndarray:
        """Per pair (r[k], c[k]): the entry if known, else its forward part (priced now if
        missing) plus its backward's lower bound: at most the entry (IEEE sums of
        non-negative terms are monotonic), so a sum with it that passes a cap rules the
        entry out before its backward is priced."""
        self.fill_forward(r, c)
        return np.where(self.known[r, c], self.M[r, c], self.Mf[r, c] + self.lower_bwd[r, c])

    def fill(self, r: np.ndarray, c: np.ndarray) -> None:
        """Compute the unknown entries among the pairs (r[k], c[k]): forward plus backward
        time (`Evaluator.edge_time`'s sum), the forward part reused when known."""
        r, c = self._todo(r, c, self.known)
        if not len(r):
            return
        ev, shape, rows, cols = self.pb.ev, self.shape, self.rows, self.cols
        half = self.fwd_known[r, c].tolist()
        ft = self.Mf[r, c].tolist()
        pairs = [(rows[i], cols[j]) for i, j in zip(r.tolist(), c.tolist())]
        ev.find_loads(shape, pairs, [not h for h in half], backward=True)
        vals = np.array([(ft[k] if half[k] else ev.edge_forward(shape, *a, *b)) +
                         ev.edge_backward(shape, *a, *b) for k, (a, b) in enumerate(pairs)])
        self.M[r, c] = vals
        self.known[r, c] = True
        self.pb.edge_evaluations += len(vals)
        if vals.min() < 0:   # the pruned min-plus relies on edge times >= 0
            self.pb.nonnegative = False

    def row(self, r: int) -> np.ndarray:
        if not self.known[r].all():
            self.fill(np.full(self.M.shape[1], r), np.arange(self.M.shape[1]))
        return self.M[r]

    def col(self, c: int) -> np.ndarray:
        if not self.known[:, c].all():
            self.fill(np.arange(self.M.shape[0]), np.full(self.M.shape[0], c))
        return self.M[:, c]

    def get(self, r: int, c: int) -> float:
        if not self.known[r, c]:
            self.fill(np.array([r]), np.array([c]))
        return float(self.M[r, c])

    def fill_all(self) -> None:
        r, c = np.nonzero(~self.known)
        if len(r):
            self.fill(r, c)



class _EdgeView:
    """One edge class's view of a shared `_EdgeTable`: its candidates' rows and columns."""

    def __init__(self, table: _EdgeTable, row_of: np.ndarray, col_of: np.ndarray):
        self.table, self.row_of, self.col_of = table, row_of, col_of
        self.M, self.known, self.match = table.M, table.known, table.match
        self.fill, self.row, self.col, self.get = table.fill, table.row, table.col, table.get
        self.fill_all, self.forward_bound = table.fill_all, table.forward_bound
        self.survivors = table.survivors

    @property
    def lower(self) -> np.ndarray:
        return self.table.lower


def _layout_index(cands: list, key) -> tuple[list, np.ndarray]:
    """The distinct ``key(s)`` of ``cands`` in order of first appearance and, per candidate,
    the index of its key."""
    keys: dict = {}
    of = np.array([keys.setdefault(key(s), len(keys)) for s in cands], dtype=np.int64)
    return list(keys), of


def _best_per_row(t, fu: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row (producer layout) of edge table ``t``: the least ``fu`` over the candidates with
    that layout (``inf`` for none) and the candidate that has it."""
    order = np.lexsort((fu, t.row_of))
    rows = t.row_of[order]
    first = np.ones(len(rows), dtype=bool)
    first[1:] = rows[1:] != rows[:-1]
    F = np.full(t.M.shape[0], np.inf)
    best = np.zeros(t.M.shape[0], dtype=np.int64)
    F[rows[first]] = fu[order[first]]
    best[rows[first]] = order[first]
    return F, best


def _column_limits(t, cap: float, rest: np.ndarray) -> np.ndarray:
    """Per column of ``t``: a row is useful for column c only if its value is below
    ``lim[c]`` = ``cap`` minus the least ``rest`` over the column's candidates."""
    lim = np.full(t.M.shape[1], np.inf)
    np.minimum.at(lim, t.col_of, rest)
    return cap - lim


def _seed_columns(t, F: np.ndarray, cols: np.ndarray, lim: np.ndarray | None) -> None:
    """Fill every column's entries for a few good rows and for its own layout's row, so the
    bound that prunes the rest is tight from the first round (``lim``: `_column_limits`)."""
    top = np.argsort(F, kind="stable")[:4]
    top = top[np.isfinite(F[top])]
    r, c = np.repeat(top, len(cols)), np.tile(cols, len(top))
    t.fill(*_below_limit(t, F, r, c, lim))
    match = t.match[cols]
    ok = match >= 0
    ok[ok] = np.isfinite(F[match[ok]])
    t.fill(*_below_limit(t, F, match[ok], cols[ok], lim))


def _below_limit(t, F: np.ndarray, r: np.ndarray, c: np.ndarray, lim: np.ndarray | None):
    """The pairs (r[k], c[k]) whose row value ``F`` plus the entry's lower bound is below
    ``lim`` of its column (all of them without ``lim``), each direction's walk floor raised
    first (`_EdgeTable.raise_floors`)."""
    if lim is None:
        return r, c
    keep = F[r] + t.lower[r, c] < lim[c]     # the dense bound first
    r, c = r[keep], c[keep]
    k = t.survivors(r, c, lambda k, bound: F[r[k]] + bound < lim[c[k]], price=False)
    return r[k], c[k]


def _price_best_first(pb, t, rows: np.ndarray, cols: np.ndarray, Fr: np.ndarray,
                      lim: np.ndarray | None) -> None:
    """Price every unknown entry of ``t`` (rows ``rows`` with values ``Fr``, columns ``cols``)
    that can lower its column's least sum: one whose row value plus lower bound is below the
    column's least sum over the priced entries (below ``lim`` too, when given). Each column's
    candidates are priced in increasing order of that bound, in batches that double, and
    dropped once the bound reaches the least sum so far, so a column prices few entries
    beyond those below its final minimum (the bound is below the entry by a relative 1e-9,
    so an entry that ties with the minimum is always priced)."""
    gc = (Fr[:, None] + t.M[np.ix_(rows, cols)]).min(axis=0)
    low = Fr[:, None] + t.lower[np.ix_(rows, cols)]
    need = (low < gc[None, :]) & ~t.known[np.ix_(rows, cols)]
    if lim is not None:
        need &= low < lim[cols][None, :]
    i, j = np.nonzero(need)
    lv = low[i, j]
    order = np.lexsort((lv, j))          # by column, then by bound
    i, j, lv = i[order], j[order], lv[order]
    batch = 1
    while len(i):
        first = np.ones(len(j), dtype=bool)
        first[1:] = j[1:] != j[:-1]
        start = np.maximum.accumulate(np.where(first, np.arange(len(j)), 0))
        take = np.arange(len(j)) - start < batch
        ti, tj = _forward_first(t, rows, cols, Fr, gc, i[take], j[take])
        if pb.nonnegative:
            t.fill(rows[ti], cols[tj])
        if not pb.nonnegative:            # a negative edge time: pruning is no longer exact
            t.fill_all()
            return
        np.minimum.at(gc, tj, Fr[ti] + t.M[rows[ti], cols[tj]])
        keep = ~take & (lv < gc[j])
        i, j, lv = i[keep], j[keep], lv[keep]
        batch *= 2


def _forward_first(t, rows, cols, Fr, gc, ti, tj) -> tuple[np.ndarray, np.ndarray]:
    """Of the entries ``(rows[ti], cols[tj])`` `_price_best_first` is about to price, the
    ones still needed once their forward part is priced: an unknown entry whose row value
    plus forward time plus backward bound exceeds its column's least sum ``gc`` cannot lower
    it nor tie with it (IEEE sums of non-negative terms are monotonic), so its backward part
    is not priced (here; another product may still need it)."""
    r, c = rows[ti], cols[tj]
    k = t.survivors(r, c, lambda k, bound: t.known[r[k], c[k]] | (Fr[ti[k]] + bound <= gc[tj[k]]))
    return ti[k], tj[k]


class Problem:
    """The search problem as arrays: per layer its candidates, node times and memory; per edge
    class an `_EdgeTable` filled on demand (coordinate descent reads rows and columns of it,
    the dynamic programme only the entries that can change a minimum)."""

    def __init__(self, graph, cluster, memory_limit=None, micro_batches=1, max_dims=3,
                 zero=False, spaces=None, in_flight: int = 1, shared: dict | None = None,
                 recompute: bool = False):
        """``in_flight``: micro-batches whose activations a device keeps at once (a pipeline
        stage's schedule); ``shared``: caches of node terms and edge tables shared by
        problems on the same cluster and micro-batch count (pipeline stages);
        ``recompute``: per-layer activation recomputation in the space."""
        self.graph, self.cluster = graph, cluster
        self.limit = memory_limit
        self.shared = shared if shared is not None else {}
        self.ev = Evaluator(graph, cluster, micro_batches,
                            self.shared.setdefault("evaluator", {}))
        p = cluster.world_size
        self.cands = [spaces[l.name] if spaces else
                      layer_space(l, p, max_dims, zero, recompute, micro_batches)
                      for l in graph.layers]
        for l, c in zip(graph.layers, self.cands):
            if not c:
                raise ValueError(f"layer {l.name} has no strategy on {p} devices")
        self.node_t, self.node_m = [], []
        cache = {}
        for i, (l, c) in enumerate(zip(graph.layers, self.cands)):
            key = (l.key, id(c), not graph.succs[i])
            if key not in cache:
                terms = [self.ev.node_terms(l, s) for s in c]
                cache[key] = (np.array([t["time"] for t in terms]),
                              np.array([t["memory"]["total"] +
                                        (in_flight - 1) * t["memory"]["activations"]
                                        for t in terms]))
            t, m = cache[key]
            self.node_t.append(t)
            self.node_m.append(m)
        self.args = (micro_batches, in_flight, recompute)
        self.ties = self._tie_pairs()
        self.tables: dict = {}
        self._share_tables()
        self.evaluations = 0
        self.edge_evaluations = 0     # edge-table entries computed
        self.nonnegative = True       # every edge time seen is >= 0 (pruning is exact)

    def _tie_pairs(self) -> list:
        """``(holder, tied, agree)`` per tie whose holder is in the graph: ``agree[a, b]``
        when the tied layer's candidate b uses the holder's candidate a's weight layout."""
        g, out = self.graph, []
        for user, holder in g.ties.items():
            if holder not in g.index:
                continue
            h, i = g.index[holder], g.index[user]
            hl, il = g.layers[h], g.layers[i]
            out.append((h, i, tie_agreement(hl, self.cands[h], il, self.cands[i])))
        return out

    def tie_term(self, state) -> float:
        """PENALTY per tie whose two layers lay the shared weight out differently."""
        return PENALTY * sum(not agree[state[h], state[i]] for h, i, agree in self.ties)

    def tie_vec(self, state, v: int) -> np.ndarray | float:
        """`tie_term`'s part that depends on layer ``v``, per candidate (others fixed)."""
        out = 0.0
        for h, i, agree in self.ties:
            if v == h:
                out = out + PENALTY * ~agree[:, state[i]]
            elif v == i:
                out = out + PENALTY * ~agree[state[h], :]
        return out

    def _share_tables(self) -> None:
        """One `_EdgeView` per edge; views of edges with equal layer classes are one object,
        and their tables are shared by content (shape, rows, columns)."""
        gl, views, by_content = self.graph.layers, {}, self.shared.setdefault("tables", {})
        for u, v in self.graph.edges:
            key = (gl[u].key, id(self.cands[u]), gl[v].key, id(self.cands[v]))
            if key not in views:
                shape = tuple(gl[u].output_shape)
                nd = len(shape)
                rows, row_of = _layout_index(self.cands[u], lambda s: (s.mesh, s.output))
                cols, col_of = _layout_index(self.cands[v],
                                             lambda s: (s.mesh, _clip_axis(s.input, nd)))
                content = (shape, tuple(rows), tuple(cols))
                if content not in by_content:
                    by_content[content] = _EdgeTable(self, shape, rows, cols)
                views[key] = _EdgeView(by_content[content], row_of, col_of)
            self.tables[(u, v)] = views[key]

    # edge cost vectors ------------------------------------------------------------------------
    def in_vec(self, u: int, su: int, v: int) -> np.ndarray:
        """Edge u->v cost for every candidate of v, u fixed at candidate su."""
        t = self.tables[(u, v)]
        return t.row(int(t.row_of[su]))[t.col_of]

    def out_vec(self, u: int, v: int, sv: int) -> np.ndarray:
        """Edge u->v cost for every candidate of u, v fixed at candidate sv."""
        t = self.tables[(u, v)]
        return t.col(int(t.col_of[sv]))[t.row_of]

    def edge(self, u, su, v, sv) -> float:
        t = self.tables[(u, v)]
        return t.get(int(t.row_of[su]), int(t.col_of[sv]))

    def min_plus(self, u: int, v: int, fu: np.ndarray, cap: float | None = None,
                 rest: np.ndarray | None = None):
        """For every candidate of v: ``min over su of fu[su] + edge(u, su, v, sv)`` and the
        minimising su, exactly. Only entries that can lower a minimum are computed: with edge
        times >= 0, a producer layout whose ``fu`` already reaches a column's best value found
        so far cannot improve it, so each column needs just the rows below that value (rows
        sorted by ``fu`` near the optimum are few, and shared tables fill once).

        With ``cap`` and ``rest`` (a lower bound, per candidate of v, of everything a solution
        adds after this product) only sums below ``cap`` are wanted: an entry with
        ``fu + rest >= cap`` is never computed, and a candidate whose minimum reaches ``cap``
        may get ``inf`` or a value above its true minimum (both >= cap)."""
        t = self.tables[(u, v)]
        F, best = _best_per_row(t, fu)
        lim = _column_limits(t, cap, rest) if cap is not None and self.nonnegative else None
        if not self.nonnegative:
            t.fill_all()
        # rows that can give some column a sum below its limit, columns some row can: the
        # others only ever hold sums >= cap (or none at all), so they are left out of the
        # products (an excluded row's sums exceed every kept column's minimum: no ties)
        rows = np.nonzero(np.isfinite(F))[0]
        cols = np.arange(t.M.shape[1])
        if lim is not None and len(rows):
            rows = rows[F[rows] < lim.max()]
            cols = cols[lim > F[rows].min()] if len(rows) else cols[:0]
        g = np.full(t.M.shape[1], np.inf)
        arg = np.zeros(t.M.shape[1], dtype=np.int64)
        if not len(rows) or not len(cols):
            return g[t.col_of], best[arg][t.col_of]
        Fr = F[rows]
        if self.nonnegative:
            _seed_columns(t, F, cols, lim)
            _price_best_first(self, t, rows, cols, Fr, lim)
        s = Fr[:, None] + t.M[np.ix_(rows, cols)]
        a = np.argmin(s, axis=0)
        gc = s[a, np.arange(len(cols))]
        g[cols] = gc
        arg[cols] = rows[a]
        return g[t.col_of], best[arg][t.col_of]

    # objective --------------------------------------------------------------------------------
    def penalty(self, mem):
        if self.limit is None:
            return 0.0 * mem
        return PENALTY * np.maximum(0.0, mem - self.limit) / self.limit

    def time_of(self, state) -> float:
        t = sum(float(self.node_t[i][s]) for i, s in enumerate(state))
        return t + sum(self.edge(u, state[u], v, state[v]) for u, v in self.graph.edges)

    def memory_of(self, state) -> float:
        return sum(float(self.node_m[i][s]) for i, s in enumerate(state))

    def cost(self, state) -> float:
        self.evaluations += 1
        return self.time_of(state) + float(self.penalty(self.memory_of(state))) + \
            self.tie_term(state)

    def local_vec(self, state, v, skip=()) -> np.ndarray:
        """Time of every candidate of v with the other layers fixed (node + incident edges;
        edges to the layers in ``skip`` left out)."""
        vec = self.node_t[v].copy()
        for u in self.graph.preds[v]:
            if u not in skip:
                vec += self.in_vec(u, state[u], v)
        for w in self.graph.succs[v]:
            if w not in skip:
                vec += self.out_vec(v, w, state[w])
        return vec

    def lazy_local_vec(self, state, v: int, skip=()):
        """``(exact, low)``: `local_vec(state, v, skip)` as a function of candidate indices
        (the same sums, in the same order) and a lower bound of it for every candidate (node
        time plus the edges' lower bounds), so a caller prices only what it needs."""
        g = self.graph
        edges = [(self.tables[(u, v)], True, u) for u in g.preds[v] if u not in skip] + \
            [(self.tables[(v, w)], False, w) for w in g.succs[v] if w not in skip]
        low = self.node_t[v].copy()
        for t, into, x in edges:
            low = low + (t.lower[t.row_of[state[x]], t.col_of] if into else
                         t.lower[t.row_of, t.col_of[state[x]]])

        def exact(ks) -> np.ndarray:
            ks = np.asarray(ks, dtype=np.int64)
            vec = self.node_t[v][ks]
            for t, into, x in edges:
                if into:
                    r, c = np.full(len(ks), t.row_of[state[x]]), t.col_of[ks]
                else:
                    r, c = t.row_of[ks], np.full(len(ks), t.col_of[state[x]])
                t.fill(r, c)
                vec = vec + t.M[r, c]
            return vec
        return exact, low

    def local_objective(self, state, v: int, pen: np.ndarray) -> np.ndarray:
        """``local_vec(state, v) + pen``, exact where it can be the least entry and ``inf``
        elsewhere. Edge times are >= 0 and IEEE addition of non-negative terms never lowers a
        sum, so node time plus ``pen`` plus the edges priced so far bounds a candidate's
        objective from below: after each incident edge, a candidate whose bound exceeds the
        current candidate's objective is dropped before the next edge is priced; it cannot
        be (or tie with) the least entry."""
        if not self.nonnegative:
            return self.local_vec(state, v) + pen
        seeds = self._seeds(state, v, self.node_t[v] + pen)
        seed_obj = self._local_sums(state, v, seeds, None)[1] + pen[seeds]
        ks, vec = self._local_sums(state, v, np.arange(len(pen)), (float(seed_obj.min()), pen))
        if not self.nonnegative:   # a negative edge time seen: the bound no longer holds
            return self.local_vec(state, v) + pen
        out = np.full(len(pen), np.inf)
        out[seeds] = seed_obj      # the current candidate's objective is always exact
        out[ks] = vec + pen[ks]
        return out

    def _seeds(self, state, v: int, base: np.ndarray) -> np.ndarray:
        """A few candidates of v likely to be near the best with the neighbours fixed (the
        current one, the least ``base``, and per neighbour the least ``base`` among those
        whose layout meets it without a redistribution): the least of their objectives caps
        the bound of `local_objective` (any achieved value is at least the minimum)."""
        out = [state[v], int(np.argmin(base))]
        for u in self.graph.preds[v]:
            t = self.tables[(u, v)]
            cols = np.nonzero(t.match == t.row_of[state[u]])[0]
            self._add_best(out, np.isin(t.col_of, cols), base)
        for w in self.graph.succs[v]:
            t = self.tables[(v, w)]
            r = t.match[t.col_of[state[w]]]
            self._add_best(out, t.row_of == r, base)
        return np.unique(np.array(out, dtype=np.int64))

    @staticmethod
    def _add_best(out: list, mask: np.ndarray, base: np.ndarray) -> None:
        if mask.any():
            out.append(int(np.argmin(np.where(mask, base, np.inf))))

    def _local_sums(self, state, v: int, ks: np.ndarray, prune):
        """``(ks', sums)``: `local_vec` at the candidates ``ks`` of v (the same sums, in the
        same order), keeping, with ``prune = (cap, pen)``, only the candidates whose partial
        sum plus the lower bounds of the edges still to add plus ``pen`` stays at most
        ``cap`` after each term."""
        g = self.graph
        # (table, row or column of the fixed neighbour, True if v is the consumer)
        edges = [(self.tables[(u, v)], int(self.tables[(u, v)].row_of[state[u]]), True)
                 for u in g.preds[v]]
        edges += [(self.tables[(v, w)], int(self.tables[(v, w)].col_of[state[w]]), False)
                  for w in g.succs[v]]

        def entries(t, fixed, into, ks, table):
            if into:
                return table[fixed, t.col_of[ks]]
            return table[t.row_of[ks], fixed]

        def below(ks, part, k):
            rest = part
            for t, fixed, into in edges[k:]:
                rest = rest + entries(t, fixed, into, ks, t.lower)
            return rest + prune[1][ks] <= prune[0]

        def keep(ks, vec, k):
            if prune is None:
                return ks, vec
            ok = below(ks, vec, k)
            return ks[ok], vec[ok]
        ks, vec = keep(ks, self.node_t[v][ks], 0)
        for k, (t, fixed, into) in enumerate(edges):
            n = len(ks)
            r, c = (np.full(n, fixed), t.col_of[ks]) if into else (t.row_of[ks], np.full(n, fixed))
            if prune is not None and n:
                # the walks' floors first, then the forward part: the backward of an entry
                # ruled out by its forward part is not priced (`_EdgeTable.survivors`)
                ok = t.survivors(r, c, lambda i, bound: below(ks[i], vec[i] + bound, k + 1))
                ks, vec, r, c = ks[ok], vec[ok], r[ok], c[ok]
            t.fill(r, c)
            ks, vec = keep(ks, vec + t.M[r, c], k + 1)
        return ks, vec

    def strategy(self, state) -> Strategy:
        return Strategy(self.graph, [self.cands[i][s] for i, s in enumerate(state)])

    def random_state(self, rng) -> list:
        return [rng.randrange(len(c)) for c in self.cands]

    def megatron_state(self):
        """The best Megatron t x d under the memory limit, as candidate indices (or None)."""
        if not hasattr(self, "_megatron"):
            from .baselines import best_megatron
            self._megatron = None
            best = best_megatron(self.graph, self.cluster, self.limit or float("inf"))
            if best is not None:
                try:
                    self._megatron = [c.index(s) for c, s in zip(self.cands, best[0].layers)]
                except ValueError:
                    pass
        return None if self._megatron is None else list(self._megatron)

    def dp_state(self):
        """Data parallel where the space has it, else the first candidate."""
        out = []
        for c in self.cands:
            idx = next((i for i, s in enumerate(c) if len(s.mesh) == 1 and s.names and
                        s.names[0] == "dp"), 0)
            out.append(idx)
        return out


# algorithms -------------------------------------------------------------------------------------
def _single_sweep(pb: Problem, state, mem, out_of_time):
    """Give each layer in turn its best strategy with the others fixed. Returns (changed, mem).

    Edge times are >= 0, so node time plus penalty bounds a candidate's objective from below:
    only candidates whose bound is at most the current choice's objective get their edge
    entries priced (`Problem.local_objective`); the others cannot be the (first) minimum."""
    changed = False
    for v in range(len(state)):
        if out_of_time():
            break   # the state so far is never worse than the sweep's start
        m = mem - pb.node_m[v][state[v]] + pb.node_m[v]
        obj = pb.local_objective(state, v, pb.penalty(m) + pb.tie_vec(state, v))
        pb.evaluations += len(obj)
        k = int(np.argmin(obj))
        if obj[k] < obj[state[v]] - 1e-12 * max(1.0, abs(obj[state[v]])):
            mem = float(m[k])
            state[v] = k
            changed = True
    return changed, mem


def _paths(graph, length: int) -> list:
    """Every path of ``length`` layers along the edges (u -> its first consumer -> ...); shorter
    paths where the graph ends. Consecutive paths overlap, so a change can travel."""
    out = []
    for v0 in range(len(graph.layers)):
        if not graph.succs[v0]:
            continue
        path = [v0]
        while len(path) < length and graph.succs[path[-1]]:
            path.append(graph.succs[path[-1]][0])
        out.append(path)
    return out


def _window_sweep(pb: Problem, state, mem, length, out_of_time, max_entries=400_000):
    """For each path of ``length`` consecutive layers, the exact best joint strategy of its
    layers with every other layer fixed: a dynamic programme along the path (min-plus
    products of `Problem.min_plus`) capped by the path's current cost, so only entries that
    could beat it are computed. An edge term couples its two layers: a single-layer move that
    changes a layout pays the conversion to the unchanged neighbour, so a run of layers that
    should switch mesh together is a fixed point of single moves (AlexNet's conv2..conv5).
    A move is taken only when the whole objective (memory penalty included) goes down.
    Paths crossing an edge table of more than ``max_entries`` layout pairs are skipped: on
    spaces that large (GPT-3 on 1024 devices: 2407 x 1056) the capped products still fill
    a large part of the tables, minutes of pricing for a fraction of a percent.
    Returns (changed, mem)."""
    changed = False
    g = pb.graph
    for path in _paths(g, length):
        if out_of_time():
            break
        if any(pb.tables[e].M.size > max_entries for e in zip(path, path[1:])):
            continue
        head, loc, last, cur = _path_terms(pb, state, path)
        low_last = loc[-1]
        tails = _tail_bounds(pb, path, loc)
        f, args = loc[0], []
        if head is not None:
            fu = np.full(len(pb.cands[head]), np.inf)
            fu[state[head]] = 0.0
            f = pb.min_plus(head, path[0], fu, cap=cur, rest=tails[0])[0] + loc[0]
        for k in range(1, len(path)):
            best, arg = pb.min_plus(path[k - 1], path[k], f, cap=cur, rest=tails[k])
            pb.evaluations += len(best)
            if k < len(path) - 1:
                f = best + loc[k]
            args.append(arg)
        # exact where the bound is below the cap (only those can be taken, and the dense
        # vector's least entry is among them then), the bound (>= cap) elsewhere
        f = best + low_last
        ks = np.nonzero(f < cur)[0]
        f[ks] = best[ks] + last(ks)
        j = int(np.argmin(f))
        if not f[j] < cur - 1e-12 * max(1.0, abs(cur)):
            continue
        new = list(state)
        new[path[-1]] = j
        for k in range(len(path) - 1, 0, -1):
            new[path[k - 1]] = int(args[k - 1][new[path[k]]])
        # accept on the whole objective (penalty included; also exact if the graph has edges
        # between non-consecutive layers of the path, which the path's objective leaves out)
        before, after = pb.cost(state), pb.cost(new)
        if after < before - 1e-12 * max(1.0, abs(before)):
            state[:] = new
            mem = pb.memory_of(state)
            changed = True
    return changed, mem


def _path_terms(pb: Problem, state, path: list) -> tuple:
    """``(head, loc, last, cur)`` of `_window_sweep`'s ``path`` (two layers or more): per
    layer, node time + edges to fixed layers off the path (and, for a layer with several
    producers, the ones not on the path); for the last layer its edges to consumers off the
    path as lower bounds (``loc[-1]``), ``last`` pricing them where they can matter
    (`Problem.lazy_local_vec`); the first layer's one fixed producer ``head``, if it has
    one, left to a product priced so too (`_fixed_head`); ``cur``: the path's cost now."""
    on = set(path)
    head = _fixed_head(pb.graph, path, on)
    loc = [pb.local_vec(state, v, skip=on if k or head is None else on | {head})
           for k, v in enumerate(path[:-1])]
    last, low_last = pb.lazy_local_vec(state, path[-1], on)
    terms = [float(x[state[v]]) for x, v in zip(loc, path)]
    if head is not None:   # the sum local_vec would have made
        terms[0] += pb.edge(head, state[head], path[0], state[path[0]])
    cur = sum(terms) + float(last([state[path[-1]]])[0]) + \
        sum(pb.edge(a, state[a], b, state[b]) for a, b in zip(path, path[1:]))
    return head, loc + [low_last], last, cur


def _fixed_head(graph, path: list, on: set) -> int | None:
    """The producer of ``path``'s first layer that stays fixed, when it is its only one off
    the path: `_window_sweep` prices that edge as a capped product (only the candidates
    that can beat the path's cost), not for every candidate."""
    ins = [u for u in graph.preds[path[0]] if u not in on]
    return ins[0] if len(ins) == 1 else None


def _tail_bounds(pb: Problem, path: list, loc: list) -> list:
    """Per layer k of ``path`` and candidate: a lower bound of its local term ``loc[k]`` plus
    everything after it along the path (the edges' lower bounds, `_EdgeTable.lower`, and the
    next layers' local terms), by a backward min-plus pass over the dense bounds."""
    out = [None] * len(path)
    out[-1] = loc[-1]
    for k in range(len(path) - 2, -1, -1):
        t = pb.tables[(path[k], path[k + 1])]
        per_col = np.full(t.M.shape[1], np.inf)
        np.minimum.at(per_col, t.col_of, out[k + 1])
        per_row = (t.lower + per_col[None, :]).min(axis=1)
        out[k] = loc[k] + per_row[t.row_of]
    return out


def _coordinate_descent(pb: Problem, rng, budget_s, t0, trace, restarts=3, start=None,
                        window: int = 4, window_max_entries: int = 400_000):
    best_state, best = None, math.inf

    def out_of_time():
        return budget_s is not None and time.perf_counter() - t0 > budget_s

    for r in range(restarts + 1):
        if r > 0 and out_of_time():
            break
        if r == 0:
            state = list(start) if start is not None else pb.dp_state()
        elif r == 1 and pb.megatron_state() is not None:
            state = pb.megatron_state()
        elif r % 2 == 0 and best_state is not None:
            # iterated local search: kick the best state (a quarter of the layers re-drawn)
            fresh = pb.random_state(rng)
            state = [f if rng.random() < 0.25 else b for f, b in zip(fresh, best_state)]
        else:
            state = pb.random_state(rng)
        mem = pb.memory_of(state)
        cur = pb.cost(state)
        if cur < best:
            best, best_state = cur, list(state)
            trace.append((time.perf_counter() - t0, best))
        while not out_of_time():
            # single-layer sweeps to a fixed point, then one sweep of joint moves of paths of
            # ``window`` layers; stop when neither changes anything. Every accepted move
            # lowers the objective, so the descent never ends above its start.
            changed, mem = _single_sweep(pb, state, mem, out_of_time)
            if not changed and window > 1:
                changed, mem = _window_sweep(pb, state, mem, window, out_of_time,
                                             window_max_entries)
            cur = pb.cost(state)
            if cur < best:
                best, best_state = cur, list(state)
                trace.append((time.perf_counter() - t0, best))
            if not changed:
                break
    return best_state, best


def _metropolis(pb: Problem, rng, budget_s, t0, trace, iterations=None, beta=20.0, start=None):
    state = list(start) if start is not None else pb.dp_state()
    cur = pb.cost(state)
    mem = pb.memory_of(state)
    best, best_state = cur, list(state)
    trace.append((time.perf_counter() - t0, best))
    scale = beta / max(cur, 1e-30) if cur < PENALTY else beta / PENALTY
    n = len(pb.graph.layers)
    iterations = iterations if iterations is not None else 300 * n
    g = pb.graph
    for it in range(iterations):
        if budget_s is not None and (it & 63) == 0 and time.perf_counter() - t0 > budget_s:
            break
        v = rng.randrange(n)
        k = rng.randrange(len(pb.cands[v]))
        old = state[v]
        if k == old:
            continue

        def local(x):
            t = pb.node_t[v][x]
            t += sum(pb.edge(u, state[u], v, x) for u in g.preds[v])
            t += sum(pb.edge(v, x, w, state[w]) for w in g.succs[v])
            return t
        m_new = mem - pb.node_m[v][old] + pb.node_m[v][k]
        delta = (local(k) + pb.penalty(m_new)) - (local(old) + pb.penalty(mem))
        pb.evaluations += 1
        if delta <= 0 or rng.random() < math.exp(-scale * delta):
            state[v], mem, cur = k, float(m_new), cur + float(delta)
            if cur < best - 1e-15:
                best, best_state = cur, list(state)
                trace.append((time.perf_counter() - t0, best))
    return best_state, pb.cost(best_state)


def _random(pb: Problem, rng, budget_s, t0, trace, samples=None):
    samples = samples if samples is not None else 100 * len(pb.graph.layers)
    best, best_state = math.inf, None
    for it in range(samples):
        if budget_s is not None and (it & 15) == 0 and time.perf_counter() - t0 > budget_s:
            break
        state = pb.random_state(rng)
        c = pb.cost(state)
        if c < best:
            best, best_state = c, state
            trace.append((time.perf_counter() - t0, best))
    return best_state, best


def _dp_once(pb: Problem, price: float, start=None):
    """Exact minimum of time + price * memory over an in-tree (children before parents).

    Bounded: a greedy pass, data parallelism or ``start`` gives an achievable value ``U``; a
    product
    entry whose prefix value
    plus a lower bound of everything else (the least local term of every layer outside the
    producer's subtree, edges >= 0) reaches ``U`` is never priced. Every entry on an optimal
    path stays below ``U``, so the optimum is exact (`Problem.min_plus`)."""
    g = pb.graph
    n = len(g.layers)
    loc = [pb.node_t[v] + price * pb.node_m[v] for v in range(n)]
    cap = None
    if pb.nonnegative:
        value = min(sum(float(loc[v][k]) for v, k in enumerate(x)) +
                    sum(pb.edge(u, x[u], v, x[v]) for u, v in g.edges)
                    for x in (_greedy_state(pb, loc), pb.dp_state()) +
                    ((list(start),) if start is not None else ()))
        cap = value * (1 + 1e-9) + 1e-300   # rounding of the bound's sums: keep ties inside
        low = [float(x.min()) for x in loc]
        sub = list(low)                      # least local terms over each layer's subtree
        for v in range(n):
            for u in g.preds[v]:
                sub[v] += sub[u]
        tail, others = _tree_tail_bounds(pb, loc, sub)
    f = [None] * n
    choice = [dict() for _ in range(n)]   # choice[v][u] = argmin over u for each candidate of v
    for v in range(n):
        acc = loc[v]
        for u in g.preds[v]:
            rest = None if cap is None else \
                tail[v] + (others[v] + sum(sub[x] for x in g.preds[v] if x != u))
            best, arg = pb.min_plus(u, v, f[u], cap, rest)
            acc = acc + best
            choice[v][u] = arg
        f[v] = acc
    state = [None] * n
    for v in reversed(range(n)):
        if state[v] is None:   # a root (no consumer)
            state[v] = int(np.argmin(f[v]))
        for u, arg in choice[v].items():
            state[u] = int(arg[state[v]])
    return state


def _tree_tail_bounds(pb: Problem, loc: list, sub: list) -> tuple[list, list]:
    """For the dynamic programme over an in-tree: per layer v and candidate, a lower bound of
    v's local term plus everything on the way to its root (the edges' lower bounds, the
    layers' local terms, the least local terms of the other subtrees joining on the way),
    by a backward min-plus pass over the dense bounds; and per layer the least local terms
    of the layers in other trees (a forest)."""
    g = pb.graph
    n = len(loc)
    tail: list = [None] * n
    root = list(range(n))
    for v in reversed(range(n)):
        if not g.succs[v]:
            tail[v] = loc[v]
            continue
        w = g.succs[v][0]
        root[v] = root[w]
        t = pb.tables[(v, w)]
        siblings = sum(sub[x] for x in g.preds[w] if x != v)
        per_col = np.full(t.M.shape[1], np.inf)
        np.minimum.at(per_col, t.col_of, tail[w])
        per_row = (t.lower + per_col[None, :]).min(axis=1)
        tail[v] = loc[v] + (per_row[t.row_of] + siblings)
    by_root: dict = {}
    for v in range(n):
        if not g.succs[v]:
            by_root[v] = sub[v]
    total = sum(by_root.values())
    return tail, [total - by_root[root[v]] for v in range(n)]


def _greedy_state(pb: Problem, loc: list) -> list:
    """Each layer in order takes the candidate least in its local term plus the edges from
    its producers' choices (pricing only candidates whose partial sum, plus the edge's lower
    bound, can still win)."""
    g = pb.graph
    state: list = []
    for v in range(len(loc)):
        base = loc[v]
        seeds = [int(np.argmin(base))]
        for u in g.preds[v]:
            t = pb.tables[(u, v)]
            cols = np.nonzero(t.match == t.row_of[state[u]])[0]
            pb._add_best(seeds, np.isin(t.col_of, cols), base)
        ks = np.unique(np.array(seeds, dtype=np.int64))
        cap = math.inf
        for prune in (False, True):
            vec = base[ks]
            for u in g.preds[v]:
                t = pb.tables[(u, v)]
                r = int(t.row_of[state[u]])
                if prune:   # an edge whose bound already passes the cap is not priced
                    ok = vec + t.lower[r, t.col_of[ks]] <= cap
                    ks, vec = ks[ok], vec[ok]
                c = t.col_of[ks]
                t.fill(np.full(len(c), r), c)
                vec = vec + t.M[r, c]
                if prune:
                    ks, vec = ks[vec <= cap], vec[vec <= cap]
            if not prune:
                cap = float(vec.min())
                ks = np.nonzero(base <= cap)[0]
        state.append(int(ks[np.argmin(vec)]))
    return state


def _exhaustive(pb: Problem, rng, budget_s, t0, trace, bisections: int = 30, start=None):
    """The exact optimum by dynamic programming (``start``: a state whose value tightens the
    bound that prunes the products; the result does not depend on it). With tied weights:
    per distinct weight layout of the first tie's holder, the holder restricted to it and
    the tied layer to the candidates that agree, the optimum of each (`_tied_exhaustive`)."""
    if not pb.graph.is_in_tree:
        raise ValueError("exhaustive search needs every layer to feed at most one consumer")
    if any(not agree.all() for _, _, agree in pb.ties):
        return _tied_exhaustive(pb, rng, budget_s, t0, trace, bisections)
    if pb.limit is None:
        state = _dp_once(pb, 0.0, start)
        best = pb.cost(state)
        trace.append((time.perf_counter() - t0, best))
        return state, best
    # Over the limit the objective is time + pp * (memory - limit) with pp = PENALTY / limit,
    # and for every strategy objective >= time + pp * (memory - limit) (the hinge is >= its
    # linear part). So the DP at price pp is a lower bound on every objective, attained by its
    # own strategy when that is over the limit too: then it is the exact optimum (the case
    # when nothing fits, e.g. GPT-3 on 1024 devices without micro-batches) and one pass does.
    pp = PENALTY / pb.limit
    top = _dp_once(pb, pp, start)
    cand = [top]
    if pb.memory_of(top) <= pb.limit:
        state = _dp_once(pb, 0.0, start)
        cand.append(state)
        if pb.memory_of(state) > pb.limit:
            # the unconstrained optimum is over the limit and something fits: the best
            # feasible strategy by Lagrangian relaxation, bisecting the price per byte
            # between 0 (over) and pp (fits); exact unless the relaxation has a duality gap
            lo, hi = 0.0, pp
            for _ in range(bisections):
                mid = (lo + hi) / 2
                s = _dp_once(pb, mid, start)
                cand.append(s)
                if pb.memory_of(s) <= pb.limit:
                    hi = mid
                else:
                    lo = mid
                if hi - lo <= 1e-9 * hi:
                    break
    state = min(cand, key=pb.cost)
    best = pb.cost(state)
    trace.append((time.perf_counter() - t0, best))
    return state, best


def _tied_exhaustive(pb: Problem, rng, budget_s, t0, trace, bisections: int):
    """`_exhaustive` with the first tie not yet fixed to each of its holder's weight layouts in turn
    (recursing over the other ties), in candidate indices of ``pb``; the least cost wins."""
    h, i, agree = next(t for t in pb.ties if not t[2].all())
    g = pb.graph
    hl = g.layers[h]
    groups: dict = {}
    for a, c in enumerate(pb.cands[h]):
        groups.setdefault(weight_layout(hl, c), []).append(a)
    best_state, best = None, math.inf
    for rows in groups.values():
        cols = np.nonzero(agree[rows].any(axis=0))[0]
        if not len(cols):
            continue
        spaces = {l.name: c for l, c in zip(g.layers, pb.cands)}
        spaces[hl.name] = [pb.cands[h][a] for a in rows]
        spaces[g.layers[i].name] = [pb.cands[i][b] for b in cols]
        m, inflight, rc = pb.args
        sub = Problem(g, pb.cluster, pb.limit, m, zero=False, spaces=spaces,
                      in_flight=inflight, shared=pb.shared, recompute=rc)
        state, _ = _exhaustive(sub, rng, budget_s, t0, [], bisections)
        pb.evaluations += sub.evaluations
        pb.edge_evaluations += sub.edge_evaluations
        full = list(state)
        full[h], full[i] = rows[state[h]], int(cols[state[i]])
        cost = pb.cost(full)
        if cost < best:
            best, best_state = cost, full
    trace.append((time.perf_counter() - t0, best))
    return best_state, best


def _enumerate(pb: Problem, rng, budget_s, t0, trace, max_combinations=2_000_000):
    total = math.prod(len(c) for c in pb.cands)
    if total > max_combinations:
        raise ValueError(f"enumeration of {total} strategies is too many; use 'exhaustive'")
    best, best_state = math.inf, None
    for state in itertools.product(*[range(len(c)) for c in pb.cands]):
        c = pb.cost(state)
        if c < best:
            best, best_state = c, list(state)
            trace.append((time.perf_counter() - t0, best))
    return best_state, best


ALGORITHMS = {"cd": _coordinate_descent, "mh": _metropolis, "random": _random,
              "exhaustive": _exhaustive, "enumerate": _enumerate}


def check_memory_limit(memory_limit) -> None:
    """A memory limit is None (the cluster's memory, if any) or a number of bytes > 0 (inf:
    none); anything else raises `CostError` (a limit of 0 made the search divide by it)."""
    if memory_limit is None:
        return
    ok = isinstance(memory_limit, numbers.Real) and not isinstance(memory_limit, bool)
    if not ok or math.isnan(memory_limit) or memory_limit <= 0:
        raise CostError(f"memory_limit must be a number of bytes > 0 (or None: the cluster's "
                        f"memory_per_device), got {memory_limit!r}; e.g. 80 * 2**30 for 80 GiB")


def _start_index(cands: list, s) -> int:
    """Where a descent from ``s`` starts among ``cands``: ``s`` itself, else the first candidate
    with its mesh and activation layouts (a stage of a pipeline gives a tied layer its own copy
    of the weight, which the whole model's strategy leaves out), else the first."""
    try:
        return cands.index(s)
    except ValueError:
        return next((k for k, c in enumerate(cands)
                     if (c.mesh, c.input, c.output) == (s.mesh, s.input, s.output)), 0)


@collector_paused()
def one_stage_search(graph, cluster, algorithm: str = "cd", seed: int = 0,
                     budget_s: float | None = None, memory_limit: float | None = None,
                     micro_batches=1, max_dims: int = 3,
                     zero: bool = False, in_flight: int = 1, shared: dict | None = None,
                     recompute: bool = False, **options) -> SearchResult:
    """Search a one-stage strategy for ``graph`` on ``cluster.world_size`` devices
    (``sf.auto.search``, `sbpflow.auto.pipeline_search.search`, also tries pipeline stages).

    ``memory_limit`` in bytes per device (default: ``cluster.memory_per_device`` if it has
    one; pass ``float('inf')`` for none). ``zero`` / ``recompute``: each layer's ZeRO-
    sharded / recomputing twins in the space. ``in_flight``, ``shared``: `Problem`. Options:
    ``restarts``, ``window`` (cd; 1 turns the joint moves off), ``iterations``, ``beta``
    (mh), ``samples`` (random), ``start`` (a list of candidate indices or a Strategy: where
    cd and mh start; for exhaustive a bound that prunes, the result unchanged). Bad input
    (a graph with a size below 1, an unknown algorithm, a negative budget, micro-batches
    below 1) raises `SearchInputError` naming it (`checks.check_search`)."""
    check_search(graph, algorithm, ALGORITHMS, budget_s, micro_batches)
    check_memory_limit(memory_limit)
    if memory_limit is None:
        memory_limit = getattr(cluster, "memory_per_device", None)
    if memory_limit is not None and math.isinf(memory_limit):
        memory_limit = None
    if micro_batches == "auto":
        m, last = 1, None
        limit_m = min(l.input_shape[0] for l in graph.layers)
        while m <= limit_m and whole_sequences(graph, m):
            last = one_stage_search(graph, cluster, algorithm, seed, budget_s, memory_limit, m,
                                    max_dims, zero, in_flight, None, recompute, **options)
            if last.fits:
                return last
            m *= 2
        return last
    check_whole_sequences(graph, micro_batches)
    pb = Problem(graph, cluster, memory_limit, micro_batches, max_dims, zero,
                 in_flight=in_flight, shared=shared, recompute=recompute)
    start = options.pop("start", None)
    if isinstance(start, Strategy):
        start = [_start_index(pb.cands[i], s) for i, s in enumerate(start.layers)]
    if start is not None and algorithm in ("cd", "mh", "exhaustive"):
        options["start"] = start
    rng = random.Random(seed)
    t0 = time.perf_counter()
    trace: list = []
    state, cost = ALGORITHMS[algorithm](pb, rng, budget_s, t0, trace, **options)
    seconds = time.perf_counter() - t0
    strategy = pb.strategy(state)
    return SearchResult(strategy, pb.ev.breakdown(strategy), trace, algorithm, float(cost),
                        seconds, pb.evaluations, int(micro_batches), memory_limit,
                        pb.edge_evaluations)
