"""Micro-batches hold whole sequences: an attention layer's batch split must divide each
micro-batch's ``batch // M`` sequences, in the one-stage search and the pipeline pass."""

import dataclasses

import pytest

import sbpflow as sf
from sbpflow.auto import model_graphs
from sbpflow.auto.pipeline_search import _Explorer, _Found
from sbpflow.auto.space import (PipelineShape, Strategy, layer_space, make_layer_strategy,
                                splits_sequences, whole_sequences)
from sbpflow.sbp import Split

GiB = 2 ** 30


def _cluster(nodes=2, dpn=4, **kw):
    return sf.cost.Cluster(nodes, dpn, intra=(3e-6, 1 / 240e9), inter=(1e-5, 1 / 12.5e9),
                           flops_per_device=1e12, **kw)


def _batch_split(s) -> int:
    f = 1
    for x, m in zip(s.input, s.mesh):
        if isinstance(x, Split) and x.axis == 0:
            f *= m
    return f


def test_attention_space_keeps_whole_sequences_of_a_micro_batch():
    attn = model_graphs.gpt(1, 32, 4, 8, 4, 64)["h0.attn"]     # 4 sequences, 4 heads
    full = layer_space(attn, 4)
    assert {_batch_split(s) for s in full} == {1, 2, 4}
    for m, most in [(1, 4), (2, 2), (4, 1)]:
        sp = layer_space(attn, 4, micro_batches=m)
        # exactly the strategies whose batch split divides the 4 // m sequences
        assert sp == [s for s in full if (4 // m) % _batch_split(s) == 0]
        assert max(_batch_split(s) for s in sp) == most
    assert layer_space(attn, 4, micro_batches=8) == []          # half a sequence each
    dp = make_layer_strategy(attn, (4,), ("dp",))
    assert [splits_sequences(attn, dp, m) for m in (1, 2, 4)] == [False, True, True]
    assert make_layer_strategy(attn, (4,), ("dp",), micro_batches=2) is None


def test_one_stage_search_refuses_a_count_that_splits_sequences():
    g = model_graphs.gpt(1, 32, 4, 8, 4, 64)
    c = _cluster(1, 4)
    assert whole_sequences(g, 4) and not whole_sequences(g, 8)
    r = sf.auto.search(g, c, "exhaustive", memory_limit=float("inf"), micro_batches=2,
                       stages=1)
    assert all(not splits_sequences(l, s, 2) for l, s in zip(g.layers, r.strategy.layers))
    # exact: the optimum over the restricted space is the optimum of brute force over it
    best = min(sf.auto.evaluate(g, Strategy(g, [s if l.kind != "attention" else a
                                                for l, s in zip(g.layers, r.strategy.layers)]),
                                c, 2).time
               for a in layer_space(g["h0.attn"], 4, micro_batches=2))
    assert r.breakdown.time == pytest.approx(best, rel=1e-12)
    with pytest.raises(sf.errors.GraphError, match="8 micro-batches would split"):
        sf.auto.search(g, c, micro_batches=8, stages=1)


def test_repricing_at_more_micro_batches_refuses_a_split_sequence():
    g = model_graphs.gpt(2, 32, 4, 8, 4, 64)
    c = _cluster()
    ex = _Explorer(g, c, "cd", 0, None, 3, False, "1f1b", {}, None)
    layers = [dataclasses.replace(make_layer_strategy(l, (4,), ("dp",)), stage=int(i >= 6))
              for i, l in enumerate(g.layers)]
    found = ex.priced(Strategy(g, layers, PipelineShape(2, 4, 1)), [], [0, 6])
    assert isinstance(found, _Found)
    assert ex.with_micro_batches(found, 1) is not None
    assert ex.with_micro_batches(found, 2) is None     # 2 sequences a micro-batch, 4-way split
    assert ex.with_micro_batches(found, 4) is None


@pytest.mark.parametrize("limit", [float("inf"), 0.6 * 2 ** 20])
def test_pipeline_search_returns_whole_sequences(limit):
    g = model_graphs.gpt(4, 64, 4, 16, 4, 128)
    c = _cluster()
    r = sf.auto.search(g, c, memory_limit=limit, stages="search")
    m = r.strategy.pipeline.micro_batches if r.strategy.pipeline else r.micro_batches
    assert whole_sequences(g, m)
    assert all(not splits_sequences(l, s, m) for l, s in zip(g.layers, r.strategy.layers))


def test_micro_batch_ladder_has_the_batch_divisors_and_keeps_whole_sequences():
    from sbpflow.auto.pipeline_search import micro_batch_ladder
    g = model_graphs.gpt(2, 64, 4, 16, 48, 128)
    # s x 2^k: 4, 8, 16, 32 (32 splits a sequence: 48 / 32); divisors of 48 from 4 up
    assert micro_batch_ladder(g, 4) == [4, 6, 8, 12, 16, 24, 48]
    assert micro_batch_ladder(g, 3) == [3, 4, 6, 8, 12, 16, 24, 48]
    # no attention: s x 2^k up to the batch, as before
    assert micro_batch_ladder(model_graphs.mlp((64, 64, 64), batch=32), 2) == [2, 4, 8, 16, 32]
