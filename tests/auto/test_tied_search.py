"""Tied weights are one layout in the search (issue 19, part 4): the holder and the tied layer
agree on the shared weight's mesh and layout, and the exact search's cost is brute force over
the agreeing strategies."""

import dataclasses
import itertools

import pytest

import sbpflow as sf
from sbpflow.auto import model_graphs as mg
from sbpflow.auto.graph import Graph
from sbpflow.auto.search import PENALTY, Problem
from sbpflow.auto.space import make_layer_strategy, tie_agrees, weight_layout
from sbpflow.sbp import B, S

GiB = 2 ** 30


def _cluster(nodes=1, dpn=4):
    return sf.cost.Cluster(nodes, dpn, intra=(3e-6, 1 / 240e9), inter=(1e-5, 1 / 12.5e9),
                           flops_per_device=1e12)


def _tiny():
    """embed (vocab 64, d 32) -> qkv -> head (96 -> 64) tied to embed: small enough to
    enumerate."""
    g = mg.gpt(1, 32, 4, 8, 2, 64, tied=True)
    return Graph([g["embed"], g["h0.qkv"], dataclasses.replace(
        g["head"], input_shape=(16, 96), flops=2.0 * 16 * 96 * 64)], name="tied-tiny")


def test_weight_layout_maps_a_linear_to_torch_axes():
    g = mg.gpt(1, 32, 4, 8, 2, 64, tied=True)
    emb, head = g["embed"], g["head"]
    vocab = make_layer_strategy(emb, (4,), ("vocab",))
    col = make_layer_strategy(head, (4,), ("col",))      # splits the head's vocab columns
    row = make_layer_strategy(head, (4,), ("row",))
    assert col.weight is None and weight_layout(head, col) == ((4,), (S(0),))
    assert weight_layout(emb, vocab) == ((4,), (S(0),))
    assert tie_agrees(emb, vocab, head, col) and not tie_agrees(emb, vocab, head, row)
    dp = make_layer_strategy(emb, (4,), ("dp",))
    assert tie_agrees(emb, dp, head, make_layer_strategy(head, (4,), ("dp",)))
    assert weight_layout(emb, dp) == ((4,), (B,))
    assert not tie_agrees(emb, dp, head, make_layer_strategy(head, (2, 2), ("dp", "dp")))


def test_exact_search_is_brute_force_over_agreeing_strategies():
    g, c = _tiny(), _cluster()
    pb = Problem(g, c)
    h, i = g.index["embed"], g.index["head"]
    best = min(pb.time_of(x) for x in itertools.product(*[range(len(k)) for k in pb.cands])
               if tie_agrees(g.layers[h], pb.cands[h][x[h]], g.layers[i], pb.cands[i][x[i]]))
    for alg in ("exhaustive", "cd"):
        r = sf.auto.search(g, c, alg, memory_limit=float("inf"), stages=1)
        s = r.strategy
        assert tie_agrees(g["embed"], s["embed"], g["head"], s["head"]), alg
        assert r.cost < PENALTY
        if alg == "exhaustive":
            assert r.cost == pytest.approx(best, rel=1e-12)
        else:
            assert r.cost >= best * (1 - 1e-12)


def test_untied_optimum_disagrees_so_the_tie_constrains():
    # the same graph with the head's own weight: its optimum lays the two weights out
    # differently, so the tie changes the answer (the test above is not vacuous)
    g, c = _tiny(), _cluster()
    head = dataclasses.replace(g["head"], tied=None, weight_shape=(96, 64))
    free = Graph([g["embed"], g["h0.qkv"], head], name="untied")
    r = sf.auto.search(free, c, "exhaustive", memory_limit=float("inf"), stages=1)
    tied = sf.auto.search(g, c, "exhaustive", memory_limit=float("inf"), stages=1)
    assert not tie_agrees(free["embed"], r.strategy["embed"], g["head"], r.strategy["head"])
    assert tied.cost > r.cost


def test_gpt2_tied_counts_the_weight_once():
    g = mg.gpt(tied=True)
    assert g.params == pytest.approx(123.5e6, rel=2e-3)


def test_search_cli_gpt2_is_tied_and_its_search_keeps_the_tie():
    from sbpflow.auto.search_cli import build_graph
    g = build_graph("gpt", batch=2, layers=1, seq=64)
    assert g.ties == {"head": "embed"}
    # GPT-2 124M: 50257 x 768 embedding (the head uses it) + 12 blocks of 12 x 768^2 weights
    assert build_graph("gpt").params == 50257 * 768 + 12 * 12 * 768 ** 2 == 123_532_032
    r = sf.auto.search(g, _cluster(), memory_limit=float("inf"), stages=1)
    assert tie_agrees(g["embed"], r.strategy["embed"], g["head"], r.strategy["head"])
