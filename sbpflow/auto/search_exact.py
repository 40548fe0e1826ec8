"""Exact searches: dynamic programming (``"exhaustive"``) and enumeration (``"enumerate"``).

`dp_once` is the exact minimum of time + price * memory over an in-tree of layers: min-plus
products (`Problem.min_plus`) that skip entries which cannot lower a minimum, bounded by a greedy
pass. `exhaustive` handles a memory limit as a Lagrangian price (bisected when the unconstrained
optimum does not fit) and tied weights by fixing the holder's weight layout in turn.
See docs/auto.md, 'How the search works'.
"""

from __future__ import annotations

import itertools
import math
import time

import numpy as np

from .search_problem import PENALTY, Problem, add_least
from .space import weight_layout

__all__ = ["dp_once", "exhaustive", "enumerate_strategies"]


def dp_once(pb: Problem, price: float, start=None):
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
            add_least(seeds, np.isin(t.col_of, cols), base)
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


def exhaustive(pb: Problem, rng, budget_s, t0, trace, bisections: int = 30, start=None):
    """The exact optimum by dynamic programming (``start``: a state whose value tightens the
    bound that prunes the products; the result does not depend on it). With tied weights:
    per distinct weight layout of the first tie's holder, the holder restricted to it and
    the tied layer to the candidates that agree, the optimum of each (`_tied_exhaustive`)."""
    if not pb.graph.is_in_tree:
        raise ValueError("exhaustive search needs every layer to feed at most one consumer")
    if any(not agree.all() for _, _, agree in pb.ties):
        return _tied_exhaustive(pb, rng, budget_s=budget_s, t0=t0, trace=trace,
                                bisections=bisections)
    if pb.limit is None:
        state = dp_once(pb, 0.0, start)
        best = pb.cost(state)
        trace.append((time.perf_counter() - t0, best))
        return state, best
    # Over the limit the objective is time + pp * (memory - limit) with pp = PENALTY / limit,
    # and for every strategy objective >= time + pp * (memory - limit) (the hinge is >= its
    # linear part). So the DP at price pp is a lower bound on every objective, attained by its
    # own strategy when that is over the limit too: then it is the exact optimum (the case
    # when nothing fits, e.g. GPT-3 on 1024 devices without micro-batches) and one pass does.
    pp = PENALTY / pb.limit
    top = dp_once(pb, pp, start)
    cand = [top]
    if pb.memory_of(top) <= pb.limit:
        state = dp_once(pb, 0.0, start)
        cand.append(state)
        if pb.memory_of(state) > pb.limit:
            # the unconstrained optimum is over the limit and something fits: the best
            # feasible strategy by Lagrangian relaxation, bisecting the price per byte
            # between 0 (over) and pp (fits); exact unless the relaxation has a duality gap
            lo, hi = 0.0, pp
            for _ in range(bisections):
                mid = (lo + hi) / 2
                s = dp_once(pb, mid, start)
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
    """`exhaustive` with the first tie not yet fixed to each of its holder's weight layouts in turn
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
        sub = Problem(g, pb.cluster, memory_limit=pb.limit, micro_batches=m, zero=False,
                      spaces=spaces, in_flight=inflight, shared=pb.shared, recompute=rc)
        state, _ = exhaustive(sub, rng, budget_s=budget_s, t0=t0, trace=[],
                              bisections=bisections)
        pb.evaluations += sub.evaluations
        pb.edge_evaluations += sub.edge_evaluations
        full = list(state)
        full[h], full[i] = rows[state[h]], int(cols[state[i]])
        cost = pb.cost(full)
        if cost < best:
            best, best_state = cost, full
    trace.append((time.perf_counter() - t0, best))
    return best_state, best


def enumerate_strategies(pb: Problem, rng, budget_s, t0, trace, max_combinations=2_000_000):
    """The optimum by trying every combination of candidates (at most ``max_combinations``)."""
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
