"""Per-layer activation recomputation in the strategy space (issue 17, part 4): memory saved is
the layer's saved activations except its input, compute added one forward; the search meets
memory with the cheapest combination."""

import dataclasses
import itertools

import pytest

import sbpflow as sf
from sbpflow.auto import model_graphs
from sbpflow.auto.space import Strategy, layer_space, make_layer_strategy

GiB = 2 ** 30
FLOPS = 1e12


def _cluster(**kw):
    kw.setdefault("memory_per_device", 80 * GiB)
    return sf.cost.Cluster(1, 2, intra=(3e-6, 1 / 240e9), inter=(1e-5, 1 / 12.5e9),
                           flops_per_device=FLOPS, **kw)


def test_recomputation_saves_the_output_and_costs_one_forward():
    g = model_graphs.mlp((64, 128, 64), batch=32)       # fp32, 32 tokens
    c = _cluster()
    plain = [make_layer_strategy(l, (2,), ("dp",)) for l in g.layers]
    rc = [dataclasses.replace(s, recompute=True) for s in plain]
    m = 4
    a = sf.auto.evaluate(g, Strategy(g, plain), c, m)
    b = sf.auto.evaluate(g, Strategy(g, [plain[0], rc[1]]), c, m)
    f1 = 2 * 32 * 128 * 64                                # fc1's forward flops
    assert b.compute_time - a.compute_time == pytest.approx(f1 / 2 / FLOPS, rel=1e-12)
    # fc1 keeps its input (16 x 128 a device) but not its output (16 x 64), per micro-batch
    saved = 16 * 64 * 4 / m
    assert a.memory["activations"] - b.memory["activations"] == pytest.approx(saved, rel=1e-12)
    assert b.memory["params"] == a.memory["params"]
    assert b.time - a.time == pytest.approx(f1 / 2 / FLOPS, rel=1e-12)   # no comm changes
    assert "+rc" in Strategy(g, rc).table()
    # the space: every plain strategy and its recomputing twin, plain ones first
    l = g.layers[1]
    sp = layer_space(l, 2, recompute=True)
    n = len(layer_space(l, 2))
    assert sp[:n] == layer_space(l, 2) and sp[n:] == [dataclasses.replace(s, recompute=True)
                                                      for s in sp[:n]]


def test_search_meets_memory_with_the_cheapest_recomputation():
    g = model_graphs.mlp((64, 256, 256, 64), batch=512)   # activation-heavy
    c = _cluster()
    free = sf.auto.search(g, c, "exhaustive", memory_limit=float("inf"), stages=1)
    least = sf.auto.search(g, c, "exhaustive", memory_limit=1.0, stages=1,
                           recompute=True).breakdown.memory["total"]
    plain_least = sf.auto.search(g, c, "exhaustive", memory_limit=1.0,
                                 stages=1).breakdown.memory["total"]
    assert least < plain_least
    limit = (least + plain_least) / 2          # fits only with some layer recomputed
    assert not sf.auto.search(g, c, "exhaustive", memory_limit=limit, stages=1).fits
    en = sf.auto.search(g, c, "enumerate", memory_limit=limit, stages=1, recompute=True)
    assert en.fits and any(s.recompute for s in en.strategy.layers) and en.cost > free.cost
    # the cheapest strategy that fits, by brute force over evaluate
    spaces = [layer_space(l, 2, recompute=True) for l in g.layers]
    best = min(b.time for b in (sf.auto.evaluate(g, Strategy(g, list(x)), c)
                                for x in itertools.product(*spaces))
               if b.memory["total"] <= limit)
    assert en.cost == pytest.approx(best, rel=1e-12)
    # the DP prices the limit by Lagrangian relaxation: it fits, at or above the optimum
    ex = sf.auto.search(g, c, "exhaustive", memory_limit=limit, stages=1, recompute=True)
    assert ex.fits and ex.cost >= en.cost * (1 - 1e-12)
    # recomputation is never chosen when memory is not short (it only adds compute)
    r = sf.auto.search(g, c, "exhaustive", memory_limit=float("inf"), stages=1, recompute=True)
    assert r.cost == pytest.approx(free.cost, rel=1e-12)
    assert not any(s.recompute for s in r.strategy.layers)


def test_cheapest_of_zero_recomputation_micro_batches_and_stages():
    g = model_graphs.mlp((64, 256, 256, 64), batch=512)
    c = _cluster()
    least = sf.auto.search(g, c, "exhaustive", memory_limit=1.0, stages=1).breakdown.memory
    limit = 0.6 * least["total"]
    opts = dict(zero=True, recompute=True)
    r = sf.auto.search(g, c, "exhaustive", memory_limit=limit, micro_batches="auto",
                       stages="search", **opts)
    assert r.fits
    # every combination the search chooses among, each searched exactly: none is cheaper
    others = [sf.auto.search(g, c, "exhaustive", memory_limit=limit, micro_batches=m,
                             stages=1, **opts) for m in (1, 2, 4, 8)]
    others.append(sf.auto.search(g, c, "exhaustive", memory_limit=limit, stages=2, **opts))
    fitting = [o.cost for o in others if o.fits]
    assert fitting and r.cost <= min(fitting) * (1 + 1e-12)


def test_table_columns_widen_to_long_layer_names():
    g = model_graphs.mlp((64, 128, 64), batch=32)
    plain = [make_layer_strategy(l, (2,), ("dp",)) for l in g.layers]
    long = dataclasses.replace(g.layers[0], name="encoder.blocks.11.mlp.fc_in")
    g.layers[0] = long
    rows = Strategy(g, plain).table().split("\n")
    kinds = [r.index(g.layers[0].kind, len(long.name)) for r in rows[1:]]
    assert rows[1].startswith(long.name + " ") and len(set(kinds)) == 1
    assert rows[0].index("kind") == kinds[0]   # the header's columns line up with the rows
