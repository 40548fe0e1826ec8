"""sbpflow.auto.strategy_search internals: lazily filled edge tables, the pruned min-plus product of the
dynamic programme, the penalised optimum when nothing fits, joint (pair) moves of coordinate
descent. Each result is checked against plain enumeration / dense products."""

import random
import time

import numpy as np
import pytest

import sbpflow as sf
from sbpflow.auto import model_graphs
from sbpflow.auto.strategy_search import PENALTY, Problem, _coordinate_descent, _dp_once


def cluster(nodes=1, dpn=4, **kw):
    kw.setdefault("memory_per_device", 80 * 2 ** 30)
    return sf.cost.Cluster(nodes, dpn, intra=(3e-6, 1 / 240e9), inter=(1e-5, 1 / 12.5e9), **kw)


def _dense_edge(pb, u, v):
    """The full edge-time matrix (candidates of u x candidates of v), one entry at a time."""
    gl = pb.graph.layers
    return np.array([[pb.ev.edge_terms(gl[u], a, gl[v], b)["time"] for b in pb.cands[v]]
                     for a in pb.cands[u]])


@pytest.mark.parametrize("seed", range(3))
def test_pruned_min_plus_equals_dense_product(seed):
    g = model_graphs.mlp((64, 128, 32), batch=16)
    pb = Problem(g, cluster())
    dense = _dense_edge(pb, 0, 1)
    rng = np.random.default_rng(seed)
    # a spread-out prefix vector (pruning matters) and a flat one (it does not)
    for fu in (rng.exponential(1e-4, len(pb.cands[0])), np.full(len(pb.cands[0]), 1e-3)):
        best, arg = pb.min_plus(0, 1, fu)
        want = (fu[:, None] + dense).min(axis=0)
        np.testing.assert_allclose(best, want, rtol=1e-12, atol=0)
        # the chosen producer candidate attains the minimum
        np.testing.assert_allclose(fu[arg] + dense[arg, np.arange(dense.shape[1])], want,
                                   rtol=1e-12, atol=0)
    # it computed fewer entries than the dense product for the spread-out vector
    assert pb.edge_evaluations <= dense.size


def test_tables_are_shared_by_repeated_layers_and_match_the_evaluator():
    g = model_graphs.gpt(3, 32, 4, 8, 2, 64)
    pb = Problem(g, cluster())
    # embed->qkv, qkv->attn, attn->proj, proj->fc1, fc1->fc2, fc2->qkv, fc2->head
    assert len({id(t) for t in pb.tables.values()}) == 7
    rng = random.Random(0)
    for _ in range(50):
        u, v = g.edges[rng.randrange(len(g.edges))]
        su, sv = rng.randrange(len(pb.cands[u])), rng.randrange(len(pb.cands[v]))
        want = pb.ev.edge_terms(g.layers[u], pb.cands[u][su], g.layers[v], pb.cands[v][sv])
        assert pb.edge(u, su, v, sv) == want["time"]


def test_dp_is_the_penalised_optimum_when_nothing_fits():
    g = model_graphs.mlp((32, 64, 16), batch=16)
    c = cluster()
    ex = sf.auto.search(g, c, "exhaustive", memory_limit=1.0)
    en = sf.auto.search(g, c, "enumerate", memory_limit=1.0)
    assert not ex.fits and ex.cost == pytest.approx(en.cost, rel=1e-12)
    assert ex.cost > PENALTY * 0.5


def test_dp_at_a_price_equals_enumeration_of_time_plus_price_memory():
    g = model_graphs.dlrm(batch=16, dense=4, tables=2, rows=64, dim=8, bottom=(8,), top=(16, 1))
    pb = Problem(g, cluster(1, 2))
    import itertools
    for price in (0.0, 1e-6, 1e-3):
        state = _dp_once(pb, price)
        got = pb.time_of(state) + price * pb.memory_of(state)
        want = min(pb.time_of(s) + price * pb.memory_of(s)
                   for s in itertools.product(*[range(len(c)) for c in pb.cands]))
        assert got == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("case", range(2))
def test_pair_moves_never_hurt_and_descent_ends_at_a_pair_fixed_point(case):
    g, c = [(model_graphs.mlp((64, 256, 64, 32), batch=8), cluster(2, 2)),
            (model_graphs.dlrm(batch=16, dense=4, tables=2, rows=64, dim=8, bottom=(8,),
                               top=(16, 1)), cluster(1, 4))][case]
    for seed in range(4):
        pb = Problem(g, c)
        start = pb.random_state(random.Random(seed))
        t0 = time.perf_counter()
        single, c1 = _coordinate_descent(pb, random.Random(0), None, t0, [], restarts=0,
                                         start=start, window=1)
        pair, c2 = _coordinate_descent(pb, random.Random(0), None, t0, [], restarts=0,
                                       start=start, window=2)
        assert c2 <= c1 + 1e-15 <= pb.cost(start) + 2e-15
        # with unlimited width the end is optimal for every edge's two layers jointly
        for u, v in g.edges:
            s = list(pair)
            for a in range(len(pb.cands[u])):
                for b in range(len(pb.cands[v])):
                    s[u], s[v] = a, b
                    assert pb.cost(s) >= c2 - 1e-12 * c2


def test_pair_moves_escape_a_single_move_fixed_point():
    """Somewhere in these small cases a single-coordinate fixed point is not a pair fixed point
    (what the pair sweep is for); the pair descent then ends strictly lower."""
    found = False
    for g, c in [(model_graphs.mlp((64, 256, 64, 32), batch=8), cluster(2, 2)),
                 (model_graphs.dlrm(batch=16, dense=4, tables=2, rows=64, dim=8, bottom=(8,),
                              top=(16, 1)), cluster(1, 4))]:
        pb = Problem(g, c)
        for seed in range(20):
            start = pb.random_state(random.Random(seed))
            _, c1 = _coordinate_descent(pb, random.Random(0), None, 0.0, [], restarts=0,
                                        start=start, window=1)
            _, c2 = _coordinate_descent(pb, random.Random(0), None, 0.0, [], restarts=0,
                                        start=start)
            found |= c2 < c1 * (1 - 1e-9)
    assert found
