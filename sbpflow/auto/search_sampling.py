"""Sampling searches: Metropolis-Hastings (``"mh"``) and random search (``"random"``).

Baselines for the exact and descent searches (benchmarks/auto_search.py gives them the wall time
coordinate descent took); both return the best (state, objective) seen.
"""

from __future__ import annotations

import math
import time

from .search_problem import PENALTY, Problem

__all__ = ["metropolis", "random_search"]


def metropolis(pb: Problem, rng, budget_s, t0, trace, iterations=None, beta=20.0, start=None):
    """Metropolis-Hastings from data parallelism (or ``start``): ``iterations`` single-layer
    proposals, accepted with probability exp(-beta * delta / start objective); returns the
    best (state, objective) seen."""
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


def random_search(pb: Problem, rng, budget_s, t0, trace, samples=None):
    """The best of ``samples`` uniformly random strategies (or as many as the budget allows)."""
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
