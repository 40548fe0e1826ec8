"""Coordinate descent with path moves and restarts (``"cd"``, the default algorithm).

Each layer in turn takes its best candidate with the others fixed (pricing only the edge entries
of candidates that can win, `Problem.local_objective`); at a fixed point, paths of ``window``
consecutive layers move jointly (a dynamic programme along the path, capped by its current
cost), so a run of layers that should switch mesh together can. Restarts: the best Megatron
t x d, kicks of the best state, random states. See docs/auto.md, 'How the search works'.
"""

from __future__ import annotations

import math
import time

import numpy as np

from .search_problem import Problem

__all__ = ["coordinate_descent"]


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
    everything after it along the path (the edges' lower bounds, `EdgeTable.lower`, and the
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


def coordinate_descent(pb: Problem, rng, budget_s, t0, trace, restarts=3, start=None,
                        window: int = 4, window_max_entries: int = 400_000):
    """Coordinate descent from data parallelism (or ``start``), then the best Megatron t x d,
    then ``restarts`` more starts (kicks of the best state and random ones): single-layer
    sweeps to a fixed point, then joint moves of paths of ``window`` layers; returns the
    best (state, objective) seen and appends improvements to ``trace``."""
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
            changed, mem = _single_sweep(pb, state, mem=mem, out_of_time=out_of_time)
            if not changed and window > 1:
                changed, mem = _window_sweep(pb, state, mem=mem, length=window,
                                             out_of_time=out_of_time,
                                             max_entries=window_max_entries)
            cur = pb.cost(state)
            if cur < best:
                best, best_state = cur, list(state)
                trace.append((time.perf_counter() - t0, best))
            if not changed:
                break
    return best_state, best
