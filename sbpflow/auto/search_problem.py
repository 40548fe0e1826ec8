"""The strategy search problem as arrays (`Problem`).

The cost of a strategy is a sum of per-layer terms (node time and memory per candidate) and edge
terms (redistributions, in `edge_tables.EdgeTable`s over the distinct layouts, filled on demand
and shared by repeated layers), plus a memory penalty over the limit (``PENALTY`` relative) and
one per tie whose layers lay a shared weight out differently. The algorithms
(`search_exact`, `search_descent`, `search_sampling`) read it; see docs/auto.md.
"""

from __future__ import annotations

import numpy as np

from ..layouts import MeshLayout
from .edge_tables import EdgeTable, EdgeView, layout_index, min_plus_product
from .evaluate import Evaluator
from .space import Strategy, _clip_axis, layer_space, tie_agreement

__all__ = ["Problem", "PENALTY", "add_least"]

PENALTY = 1e4


def add_least(out: list, mask: np.ndarray, base: np.ndarray) -> None:
    """Append to ``out`` the candidate least in ``base`` among those ``mask`` marks (if any)."""
    if mask.any():
        out.append(int(np.argmin(np.where(mask, base, np.inf))))


class Problem:
    """The search problem as arrays: per layer its candidates, node times and memory; per edge
    class an `EdgeTable` filled on demand (coordinate descent reads rows and columns of it,
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
        """One `EdgeView` per edge; views of edges with equal layer classes are one object,
        and their tables are shared by content (shape, rows, columns)."""
        gl, views, by_content = self.graph.layers, {}, self.shared.setdefault("tables", {})
        for u, v in self.graph.edges:
            key = (gl[u].key, id(self.cands[u]), gl[v].key, id(self.cands[v]))
            if key not in views:
                shape = tuple(gl[u].output_shape)
                nd = len(shape)
                rows, row_of = layout_index(self.cands[u], lambda s: s.output_layout)
                cols, col_of = layout_index(
                    self.cands[v], lambda s: MeshLayout(s.mesh, _clip_axis(s.input, nd)))
                content = (shape, tuple(rows), tuple(cols))
                if content not in by_content:
                    by_content[content] = EdgeTable(self, shape, rows, cols)
                views[key] = EdgeView(by_content[content], row_of, col_of)
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
        minimising su, exactly, pricing only entries that can lower a minimum (with ``cap``
        and ``rest``: only sums below ``cap``), `edge_tables.min_plus_product`."""
        return min_plus_product(self, self.tables[(u, v)], fu, cap=cap, rest=rest)

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
            add_least(out, np.isin(t.col_of, cols), base)
        for w in self.graph.succs[v]:
            t = self.tables[(v, w)]
            r = t.match[t.col_of[state[w]]]
            add_least(out, t.row_of == r, base)
        return np.unique(np.array(out, dtype=np.int64))

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
                # ruled out by its forward part is not priced (`EdgeTable.survivors`)
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
