"""Edge tables of the strategy search: the edge times between two layers' candidates.

An edge is a redistribution of a producer's output into its consumer's input layout, so its time
depends on the two strategies only through their layouts: `EdgeTable` keeps those times over the
distinct layouts, filled on demand and shared by repeated layers (`EdgeView`: one edge's rows and
columns of it), with dense lower bounds raised to the walks' floors. `min_plus_product` is the
pruned min-plus product of the dynamic programmes (`Problem.min_plus`): it prices only entries
that can lower a minimum. See docs/auto.md, 'How the search works'.
"""

from __future__ import annotations

import numpy as np

from .evaluate import edge_lower_bounds

__all__ = ["EdgeTable", "EdgeView", "layout_index", "min_plus_product"]


class EdgeTable:
    """Edge times between one producer's candidates and one consumer's, filled on demand.

    An edge is a redistribution of the producer's output into the consumer's input layout, so
    its time depends on the two strategies only through the producer's output `MeshLayout`
    -- a row -- and the consumer's input one -- a column. The table holds the
    distinct rows x distinct columns of a tensor shape; edges with the same shape, rows and
    columns share one table (`Problem`), so the 96 blocks of a GPT fill it once, and so do
    edges between different layers with equal layouts (GPT-3's proj -> fc1, fc2 -> qkv and
    fc2 -> head). Unknown entries hold ``inf``."""

    def __init__(self, pb, shape: tuple, rows: list, cols: list):
        self.pb, self.shape = pb, shape
        self.rows, self.cols = rows, cols        # MeshLayouts: outputs / clipped inputs
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
            self._lower = edge_lower_bounds(self.shape, ev.itemsize, ev.cluster, rows=self.rows,
                                            cols=self.cols, micro_batches=ev.micro)
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
        return edge_lower_bounds(self.shape, ev.itemsize, ev.cluster, rows=self.rows,
                                 cols=self.cols, micro_batches=ev.micro, part=part)

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
        got = [floor(shape, rows[i], cols[j]) for i, j in zip(r.tolist(), c.tolist())]
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
        vals = np.array([ev.edge_forward(shape, a, b) for a, b in pairs])
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
        vals = np.array([(ft[k] if half[k] else ev.edge_forward(shape, a, b)) +
                         ev.edge_backward(shape, a, b) for k, (a, b) in enumerate(pairs)])
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



class EdgeView:
    """One edge class's view of a shared `EdgeTable`: its candidates' rows and columns."""

    def __init__(self, table: EdgeTable, row_of: np.ndarray, col_of: np.ndarray):
        self.table, self.row_of, self.col_of = table, row_of, col_of
        self.M, self.known, self.match = table.M, table.known, table.match
        self.fill, self.row, self.col, self.get = table.fill, table.row, table.col, table.get
        self.fill_all, self.forward_bound = table.fill_all, table.forward_bound
        self.survivors = table.survivors

    @property
    def lower(self) -> np.ndarray:
        return self.table.lower


def layout_index(cands: list, key) -> tuple[list, np.ndarray]:
    """The distinct ``key(s)`` of ``cands`` in order of first appearance and, per candidate,
    the index of its key."""
    keys: dict = {}
    of = np.array([keys.setdefault(key(s), len(keys)) for s in cands], dtype=np.int64)
    return list(keys), of


def min_plus_product(pb, t, fu: np.ndarray, cap: float | None = None,
                     rest: np.ndarray | None = None):
    """`Problem.min_plus` over the edge u -> v's table (view) ``t``: for every candidate of v,
    ``min over su of fu[su] + edge(u, su, v, sv)`` and the minimising su, exactly. Only
    entries that can lower a minimum are computed: with edge times >= 0, a producer layout
    whose ``fu`` already reaches a column's best value found so far cannot improve it, so
    each column needs just the rows below that value (rows sorted by ``fu`` near the optimum
    are few, and shared tables fill once).

    With ``cap`` and ``rest`` (a lower bound, per candidate of v, of everything a solution
    adds after this product) only sums below ``cap`` are wanted: an entry with
    ``fu + rest >= cap`` is never computed, and a candidate whose minimum reaches ``cap``
    may get ``inf`` or a value above its true minimum (both >= cap)."""
    F, best = _best_per_row(t, fu)
    lim = _column_limits(t, cap, rest) if cap is not None and pb.nonnegative else None
    if not pb.nonnegative:
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
    if pb.nonnegative:
        _seed_columns(t, F=F, cols=cols, lim=lim)
        _price_best_first(pb, t, rows=rows, cols=cols, Fr=Fr, lim=lim)
    s = Fr[:, None] + t.M[np.ix_(rows, cols)]
    a = np.argmin(s, axis=0)
    gc = s[a, np.arange(len(cols))]
    g[cols] = gc
    arg[cols] = rows[a]
    return g[t.col_of], best[arg][t.col_of]


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
    t.fill(*_below_limit(t, F=F, r=r, c=c, lim=lim))
    match = t.match[cols]
    ok = match >= 0
    ok[ok] = np.isfinite(F[match[ok]])
    t.fill(*_below_limit(t, F=F, r=match[ok], c=cols[ok], lim=lim))


def _below_limit(t, F: np.ndarray, r: np.ndarray, c: np.ndarray, lim: np.ndarray | None):
    """The pairs (r[k], c[k]) whose row value ``F`` plus the entry's lower bound is below
    ``lim`` of its column (all of them without ``lim``), each direction's walk floor raised
    first (`EdgeTable.raise_floors`)."""
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
        ti, tj = _forward_first(t, rows=rows, cols=cols, Fr=Fr, gc=gc, ti=i[take],
                                tj=j[take])
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
