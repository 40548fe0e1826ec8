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
import random
import time
from dataclasses import dataclass, field

import numpy as np

from .evaluate import Breakdown, Evaluator
from .space import Strategy, layer_space

__all__ = ["SearchResult", "search", "Problem", "PENALTY"]

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
    distinct rows x distinct columns; layers with equal keys and candidate lists share one
    table, so the 96 blocks of a GPT fill it once. Unknown entries hold ``inf``."""

    def __init__(self, pb: "Problem", u: int, v: int):
        gl = pb.graph.layers
        self.pb, self.lu, self.lv = pb, gl[u], gl[v]
        rows: dict = {}
        cols: dict = {}
        self.row_of = np.array([rows.setdefault((s.mesh, s.output), len(rows))
                                for s in pb.cands[u]], dtype=np.int64)
        self.col_of = np.array([cols.setdefault((s.mesh, s.input), len(cols))
                                for s in pb.cands[v]], dtype=np.int64)
        self.su = [None] * len(rows)   # one candidate strategy standing for each row / column
        self.sv = [None] * len(cols)
        for s, r in zip(pb.cands[u], self.row_of.tolist()):
            self.su[r] = self.su[r] or s
        for s, c in zip(pb.cands[v], self.col_of.tolist()):
            self.sv[c] = self.sv[c] or s
        # the row whose output layout is this column's input layout (usually a free edge)
        self.match = np.array([rows.get(k, -1) for k in cols], dtype=np.int64)
        self.M = np.full((len(rows), len(cols)), np.inf)
        self.known = np.zeros(self.M.shape, dtype=bool)

    def fill(self, r: np.ndarray, c: np.ndarray) -> None:
        """Compute the unknown entries among the pairs (r[k], c[k])."""
        r, c = np.asarray(r, dtype=np.int64), np.asarray(c, dtype=np.int64)
        todo = ~self.known[r, c]
        if not todo.any():
            return
        r, c = r[todo], c[todo]
        flat = np.unique(r * self.M.shape[1] + c)
        r, c = np.divmod(flat, self.M.shape[1])
        edge, lu, lv, su, sv = self.pb.ev.edge_terms, self.lu, self.lv, self.su, self.sv
        vals = np.array([edge(lu, su[i], lv, sv[j])["time"]
                         for i, j in zip(r.tolist(), c.tolist())])
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
    if lim is not None:
        keep = F[r] < lim[c]
        r, c = r[keep], c[keep]
    t.fill(r, c)
    ok = (t.match >= 0)
    ok[ok] = np.isfinite(F[t.match[ok]])
    if lim is not None:
        ok[ok] = F[t.match[ok]] < lim[ok]
    t.fill(t.match[ok], cols[ok])


class Problem:
    """The search problem as arrays: per layer its candidates, node times and memory; per edge
    class an `_EdgeTable` filled on demand (coordinate descent reads rows and columns of it,
    the dynamic programme only the entries that can change a minimum)."""

    def __init__(self, graph, cluster, memory_limit=None, micro_batches=1, max_dims=3,
                 zero=False, spaces=None):
        self.graph, self.cluster = graph, cluster
        self.limit = memory_limit
        self.ev = Evaluator(graph, cluster, micro_batches)
        p = cluster.world_size
        self.cands = [spaces[l.name] if spaces else layer_space(l, p, max_dims, zero)
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
                              np.array([t["memory"]["total"] for t in terms]))
            t, m = cache[key]
            self.node_t.append(t)
            self.node_m.append(m)
        tables: dict = {}
        self.tables: dict = {}
        gl = graph.layers
        for u, v in graph.edges:
            key = (gl[u].key, id(self.cands[u]), gl[v].key, id(self.cands[v]))
            if key not in tables:
                tables[key] = _EdgeTable(self, u, v)
            self.tables[(u, v)] = tables[key]
        self.evaluations = 0
        self.edge_evaluations = 0     # edge-table entries computed
        self.nonnegative = True       # every edge time seen is >= 0 (pruning is exact)

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
        cols = np.arange(t.M.shape[1])
        lim = _column_limits(t, cap, rest) if cap is not None and self.nonnegative else None
        if not self.nonnegative:
            t.fill_all()
        else:
            _seed_columns(t, F, cols, lim)
        while True:
            s = F[:, None] + t.M
            arg = np.argmin(s, axis=0)
            g = s[arg, cols]
            if not self.nonnegative:
                break
            need = (F[:, None] < g[None, :]) & ~t.known
            if lim is not None:
                need &= F[:, None] < lim[None, :]
            if not need.any():
                break
            t.fill(*np.nonzero(need))
            if not self.nonnegative:   # a negative edge time seen: pruning is no longer exact
                t.fill_all()
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
        return self.time_of(state) + float(self.penalty(self.memory_of(state)))

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
    """Give each layer in turn its best strategy with the others fixed. Returns (changed, mem)."""
    changed = False
    for v in range(len(state)):
        if out_of_time():
            break   # the state so far is never worse than the sweep's start
        vec = pb.local_vec(state, v)
        m = mem - pb.node_m[v][state[v]] + pb.node_m[v]
        obj = vec + pb.penalty(m)
        pb.evaluations += len(vec)
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
        on = set(path)
        # per layer: node time + edges to fixed layers off the path (and, for a layer with
        # several producers, the ones not on the path)
        loc = [pb.local_vec(state, v, skip=on) for v in path]
        cur = sum(float(x[state[v]]) for x, v in zip(loc, path)) + \
            sum(pb.edge(a, state[a], b, state[b]) for a, b in zip(path, path[1:]))
        lows = [float(x.min()) for x in loc]
        f, args = loc[0], []
        for k in range(1, len(path)):
            rest = loc[k] + sum(lows[k + 1:])
            best, arg = pb.min_plus(path[k - 1], path[k], f, cap=cur, rest=rest)
            pb.evaluations += len(best)
            f = best + loc[k]
            args.append(arg)
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


def _dp_once(pb: Problem, price: float):
    """Exact minimum of time + price * memory over an in-tree (children before parents)."""
    g = pb.graph
    n = len(g.layers)
    f = [None] * n
    choice = [dict() for _ in range(n)]   # choice[v][u] = argmin over u for each candidate of v
    for v in range(n):
        acc = pb.node_t[v] + price * pb.node_m[v]
        for u in g.preds[v]:
            best, arg = pb.min_plus(u, v, f[u])
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


def _exhaustive(pb: Problem, rng, budget_s, t0, trace, bisections: int = 30):
    if not pb.graph.is_in_tree:
        raise ValueError("exhaustive search needs every layer to feed at most one consumer")
    if pb.limit is None:
        state = _dp_once(pb, 0.0)
        best = pb.cost(state)
        trace.append((time.perf_counter() - t0, best))
        return state, best
    # Over the limit the objective is time + pp * (memory - limit) with pp = PENALTY / limit,
    # and for every strategy objective >= time + pp * (memory - limit) (the hinge is >= its
    # linear part). So the DP at price pp is a lower bound on every objective, attained by its
    # own strategy when that is over the limit too: then it is the exact optimum (the case
    # when nothing fits, e.g. GPT-3 on 1024 devices without micro-batches) and one pass does.
    pp = PENALTY / pb.limit
    top = _dp_once(pb, pp)
    cand = [top]
    if pb.memory_of(top) <= pb.limit:
        state = _dp_once(pb, 0.0)
        cand.append(state)
        if pb.memory_of(state) > pb.limit:
            # the unconstrained optimum is over the limit and something fits: the best
            # feasible strategy by Lagrangian relaxation, bisecting the price per byte
            # between 0 (over) and pp (fits); exact unless the relaxation has a duality gap
            lo, hi = 0.0, pp
            for _ in range(bisections):
                mid = (lo + hi) / 2
                s = _dp_once(pb, mid)
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


def search(graph, cluster, algorithm: str = "cd", seed: int = 0, budget_s: float | None = None,
           memory_limit: float | None = None, micro_batches=1, max_dims: int = 3,
           zero: bool = False, **options) -> SearchResult:
    """Search a strategy for ``graph`` on ``cluster.world_size`` devices.

    ``memory_limit`` in bytes per device (default: ``cluster.memory_per_device`` if it has
    one; pass ``float('inf')`` for none). Options: ``restarts``, ``window`` (cd; 1 turns
    the joint moves off), ``iterations``, ``beta``
    (mh), ``samples`` (random), ``start`` (a list of candidate indices or a Strategy)."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; one of {sorted(ALGORITHMS)}")
    if memory_limit is None:
        memory_limit = getattr(cluster, "memory_per_device", None)
    if memory_limit is not None and math.isinf(memory_limit):
        memory_limit = None
    if micro_batches == "auto":
        m, last = 1, None
        limit_m = min(l.input_shape[0] for l in graph.layers)
        while m <= limit_m:
            last = search(graph, cluster, algorithm, seed, budget_s, memory_limit, m, max_dims,
                          zero, **options)
            if last.fits:
                return last
            m *= 2
        return last
    pb = Problem(graph, cluster, memory_limit, micro_batches, max_dims, zero)
    start = options.pop("start", None)
    if isinstance(start, Strategy):
        start = [pb.cands[i].index(s) for i, s in enumerate(start.layers)]
    if start is not None and algorithm in ("cd", "mh"):
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
