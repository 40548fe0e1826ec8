"""Tied weights are one layout in the search (issue 19, part 4): the holder and the tied layer
agree on the shared weight's mesh and layout, and the exact search's cost is brute force over
the agreeing strategies."""

import dataclasses
import itertools

import pytest

import sbpflow as sf
from sbpflow.auto import model_graphs as mg
from sbpflow.auto.layer_graph import LayerGraph, Layer
from sbpflow.auto.strategy_search import PENALTY, Problem
from sbpflow.auto.space import PipelineShape, Strategy, make_layer_strategy, tie_agrees, weight_layout
from sbpflow.sbp import B, S

GiB = 2 ** 30


def _cluster(nodes=1, dpn=4):
    return sf.cost.Cluster(nodes, dpn, intra=(3e-6, 1 / 240e9), inter=(1e-5, 1 / 12.5e9),
                           flops_per_device=1e12)


def _tiny():
    """embed (vocab 64, d 32) -> qkv -> head (96 -> 64) tied to embed: small enough to
    enumerate."""
    g = mg.gpt(1, 32, 4, 8, 2, 64, tied=True)
    return LayerGraph([g["embed"], g["h0.qkv"], dataclasses.replace(
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
    free = LayerGraph([g["embed"], g["h0.qkv"], head], name="untied")
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


# -- a tie across pipeline stages: each stage holds a copy, the copies' gradients exchanged --

T, D, V = 16, 32, 64


def _tied_chain(tied=True):
    """embed (vocab 64, d 32) -> fc (32 -> 32) -> head (32 -> 64), the head tied to embed
    (``tied=False``: the head has its own (32, 64) weight)."""
    emb = Layer("embed", "embedding", (T,), (V, D), (T, D), 2.0 * T * D, False,
                {"megatron": "vocab"})
    head = mg.linear_layer("head", T, D, V, megatron="col")
    if tied:
        head = dataclasses.replace(head, weight_shape=None, tied="embed")
    return LayerGraph([emb, mg.linear_layer("fc", T, D, D), head], name="tied-chain")


def _two_stages(g, embed, head):
    """embed and fc on stage 0, head on stage 1, 2 devices a stage, 2 micro-batches, 1F1B."""
    def st(name, sig, k):
        return dataclasses.replace(make_layer_strategy(g[name], (2,), (sig,)), stage=k)
    return Strategy(g, [st("embed", embed, 0), st("fc", "dp", 0), st("head", head, 1)],
                    PipelineShape(2, 2, 2, "1f1b"))


def test_a_tie_across_stages_gives_the_last_stage_a_copy_and_one_all_reduce():
    c, alpha, beta = _cluster(), 3e-6, 1 / 240e9
    g, free = _tied_chain(), _tied_chain(tied=False)
    b = sf.auto.evaluate(g, _two_stages(g, "dp", "dp"), c)
    # stage 1 (1F1B: 1 micro-batch of 8 tokens in flight): the head's (32, 64) copy, replicated,
    # bf16 weight and gradient, two fp32 Adam states; its input and output activations
    m1 = D * V * (2 + 2 + 2 * 4) + (T // 2 // 2) * (D + V) * 2
    m0 = (V * D + D * D) * (2 + 2 + 2 * 4) + 2 * (T // 2 // 2) * (1 + D + D + D) * 2
    assert b.stage_memory == pytest.approx([m0, m1], rel=1e-12)
    # the same strategy with the head's own weight differs by the copies' exchange alone:
    # a 2-rank all-reduce of the whole (replicated) gradient, ranks 0 and 2 on one node
    u = sf.auto.evaluate(free, _two_stages(free, "dp", "dp"), c)
    assert u.stage_memory == pytest.approx(b.stage_memory, rel=1e-12)
    assert b.time - u.time == pytest.approx(2 * alpha + V * D * 2 * beta, rel=1e-9)
    assert b.grad_sync_bytes - u.grad_sync_bytes == pytest.approx(V * D * 2, rel=1e-12)


def test_a_tie_across_stages_with_different_shards_sends_each_gradient_over():
    c, alpha, beta = _cluster(), 3e-6, 1 / 240e9
    g, free = _tied_chain(), _tied_chain(tied=False)
    # agreeing: the embedding's vocab split is the head's column split; each device
    # all-reduces its half with its peer
    b = sf.auto.evaluate(g, _two_stages(g, "vocab", "col"), c)
    u = sf.auto.evaluate(free, _two_stages(free, "vocab", "col"), c)
    # the head's copy split in two; its input replicated, its output split, a micro-batch's
    assert b.stage_memory[1] == pytest.approx(D * V // 2 * 12 + (T * D + T * V // 2) * 2 // 2,
                                              rel=1e-12)
    assert b.time - u.time == pytest.approx(2 * alpha + V * D * beta, rel=1e-9)
    # replicated on stage 0, split on stage 1: the half each stage-1 device needs goes over
    # in one message, then the two halves come back to each stage-0 device in two
    b = sf.auto.evaluate(g, _two_stages(g, "dp", "col"), c)
    u = sf.auto.evaluate(free, _two_stages(free, "dp", "col"), c)
    assert b.time - u.time == pytest.approx((alpha + V * D * beta) + (2 * alpha + V * D * 2 * beta),
                                            rel=1e-9)


def test_a_ties_agreement_matrix_is_tie_agrees_of_every_pair():
    """`Problem` reads the tie as one matrix (each candidate's weight layout found once);
    every entry must be `tie_agrees` of its pair, agreeing pairs and disagreeing ones."""
    g = mg.gpt(1, 64, 4, 16, 16, 128, tied=True)
    pb = Problem(g, _cluster(nodes=2, dpn=4))
    (h, i, agree), = pb.ties
    want = [[tie_agrees(g.layers[h], a, g.layers[i], b) for b in pb.cands[i]]
            for a in pb.cands[h]]
    assert agree.tolist() == want
    assert 0 < agree.sum() < agree.size / 2
