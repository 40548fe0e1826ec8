"""Search algorithms over the strategy space.

The cost of a strategy is a sum of per-layer terms and terms on the edges between layers, so:

* ``"cd"`` coordinate descent (default): sweep the layers, give each the best strategy with the
  others fixed, until a sweep changes nothing; then restart (alternately from the best state
  with a quarter of its layers re-drawn, and from a random state), while ``restarts`` and
  ``budget_s`` allow: the first start is data parallel, the second the best Megatron t x d
  (so the result is never worse than either).
* ``"mh"`` Metropolis-Hastings (FlexFlow-style): change one random layer to a random strategy,
  accept with probability ``min(1, exp(-beta * delta / cost0))``.
* ``"random"``: independent random strategies.
* ``"exhaustive"``: dynamic programming over the layer chain (any in-tree: each layer feeds at
  most one consumer) -- the exact optimum; ``"enumerate"`` lists every combination (tiny graphs,
  to cross-check the DP).

A memory limit turns into a penalty (``PENALTY`` seconds per unit of relative excess), so a
strategy over the limit never beats one under it. For the DP a memory limit is a global sum
constraint; it is handled by Lagrangian relaxation (bisection on a price per byte), exact when
the limit does not bind and otherwise the best feasible strategy over the prices tried.
``micro_batches="auto"`` doubles the number of micro-batches (gradient accumulation) until
the best strategy fits the memory limit.

Seeded runs are reproducible when they stop on ``restarts`` / ``iterations`` / ``samples``;
``budget_s`` is a wall-clock cap on top.
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

    @property
    def fits(self) -> bool:
        """The strategy's memory per device is within the limit."""
        return self.memory_limit is None or self.breakdown.memory["total"] <= self.memory_limit

    def __str__(self) -> str:
        return (f"{self.algorithm}: cost {self.cost * 1e3:.3f} ms in {self.seconds:.2f} s "
                f"({self.evaluations} evaluations)\n{self.breakdown}\n{self.strategy.table()}")


class Problem:
    """The search problem as arrays: per layer its candidates, node times and memory; edge
    cost vectors are computed on demand and cached by (layer keys, fixed neighbour)."""

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
        self._in: dict = {}
        self._out: dict = {}
        self.evaluations = 0

    # edge cost vectors ------------------------------------------------------------------------
    def in_vec(self, u: int, su: int, v: int) -> np.ndarray:
        """Edge u->v cost for every candidate of v, u fixed at candidate su."""
        gl = self.graph.layers
        key = (gl[u].key, gl[v].key, id(self.cands[v]), su)
        vec = self._in.get(key)
        if vec is None:
            a = self.cands[u][su]
            vec = np.array([self.ev.edge_terms(gl[u], a, gl[v], b)["time"]
                            for b in self.cands[v]])
            self._in[key] = vec
        return vec

    def out_vec(self, u: int, v: int, sv: int) -> np.ndarray:
        """Edge u->v cost for every candidate of u, v fixed at candidate sv."""
        gl = self.graph.layers
        key = (gl[u].key, id(self.cands[u]), gl[v].key, sv)
        vec = self._out.get(key)
        if vec is None:
            b = self.cands[v][sv]
            vec = np.array([self.ev.edge_terms(gl[u], a, gl[v], b)["time"]
                            for a in self.cands[u]])
            self._out[key] = vec
        return vec

    def edge(self, u, su, v, sv) -> float:
        gl = self.graph.layers
        return self.ev.edge_terms(gl[u], self.cands[u][su], gl[v], self.cands[v][sv])["time"]

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

    def local_vec(self, state, v) -> np.ndarray:
        """Time of every candidate of v with the other layers fixed (node + incident edges)."""
        vec = self.node_t[v].copy()
        for u in self.graph.preds[v]:
            vec += self.in_vec(u, state[u], v)
        for w in self.graph.succs[v]:
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
def _coordinate_descent(pb: Problem, rng, budget_s, t0, trace, restarts=3, start=None):
    best_state, best = None, math.inf
    n = len(pb.graph.layers)
    for r in range(restarts + 1):
        if r > 0 and budget_s is not None and time.perf_counter() - t0 > budget_s:
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
        changed = True
        while changed:
            changed = False
            for v in range(n):
                if budget_s is not None and time.perf_counter() - t0 > budget_s:
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
            cur = pb.cost(state)
            if cur < best:
                best, best_state = cur, list(state)
                trace.append((time.perf_counter() - t0, best))
            if budget_s is not None and time.perf_counter() - t0 > budget_s:
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
            mat = np.stack([pb.in_vec(u, su, v) for su in range(len(pb.cands[u]))])  # (nu, nv)
            tot = f[u][:, None] + mat
            arg = np.argmin(tot, axis=0)
            acc = acc + tot[arg, np.arange(tot.shape[1])]
            choice[v][u] = arg
            pb.evaluations += mat.size
        f[v] = acc
    state = [None] * n
    for v in reversed(range(n)):
        if state[v] is None:   # a root (no consumer)
            state[v] = int(np.argmin(f[v]))
        for u, arg in choice[v].items():
            state[u] = int(arg[state[v]])
    return state


def _exhaustive(pb: Problem, rng, budget_s, t0, trace):
    if not pb.graph.is_in_tree:
        raise ValueError("exhaustive search needs every layer to feed at most one consumer")
    state = _dp_once(pb, 0.0)
    best = pb.cost(state)
    trace.append((time.perf_counter() - t0, best))
    if pb.limit is not None and pb.memory_of(state) > pb.limit:
        lo, hi = 0.0, None
        cand = [state]
        price = best / pb.limit
        for _ in range(60):   # grow the price until the limit is met, then bisect
            s = _dp_once(pb, price)
            cand.append(s)
            if pb.memory_of(s) <= pb.limit:
                hi = price
                break
            lo, price = price, price * 4
        if hi is not None:
            for _ in range(30):
                mid = (lo + hi) / 2
                s = _dp_once(pb, mid)
                cand.append(s)
                if pb.memory_of(s) <= pb.limit:
                    hi = mid
                else:
                    lo = mid
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
    one; pass ``float('inf')`` for none). Options: ``restarts`` (cd), ``iterations``, ``beta``
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
                        seconds, pb.evaluations, int(micro_batches), memory_limit)
