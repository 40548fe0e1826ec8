"""ZeRO stages in the strategy (issue 15): ``LayerStrategy.zero`` 1/2/3 and what `evaluate`
prices for each (the bytes of data parallelism for stages 1 and 2, half as much again for
stage 3; the memory of what each splits), the space's ZeRO twins, and `sf.auto.parallelize`
running a real ``search(..., zero=True)`` answer under a memory limit as the torch twin trains.
Memory against `sf.memory_stats`: tests/test_memory.py; each stage through parallelize:
tests/parallel/test_zero.py."""

import dataclasses
import functools

import pytest
import torch

import sbpflow as sf
from gpt_twin import torch_gpt_train
from sbpflow.auto import model_graphs
from sbpflow.auto.strategy_search import one_stage_search as search
from sbpflow.auto.space import (LayerStrategy, Strategy, layer_space, make_layer_strategy,
                                zero_twin)
from sbpflow.auto.trace import trace
from sbpflow.models import gpt_class

B, S = sf.B, sf.S
CLUSTER = sf.cost.Cluster.preset("dgx-a100", nodes=1, devices_per_node=4)


def _graph():
    return model_graphs.gpt(2, 64, 4, 16, 8, 64)


def test_stored_strategies_default_to_stage_3_and_print_as_before():
    s = LayerStrategy((4,), (S(0),), (B,), (S(0),), (S(0),), ("dp",))
    assert s.zero == 3 and s.weight_stored == (S(0),) and s.label == "dp:4 +zero"
    assert "zero=" not in repr(s)
    plain = dataclasses.replace(s, stored=None)
    assert plain.zero == 0 and plain == LayerStrategy((4,), (S(0),), (B,), (S(0),),
                                                      names=("dp",))
    one = dataclasses.replace(s, zero=1)
    assert one.weight_stored == (B,) and one.label == "dp:4 +zero1" and "zero=1" in repr(one)
    assert dataclasses.replace(s, zero=0).stored is None
    with pytest.raises(sf.SbpError, match="ZeRO stage 0-3"):
        dataclasses.replace(s, zero=4)


def test_zero_true_is_stage_3_and_stages_add_their_twins():
    layer = next(l for l in _graph().layers if l.kind == "linear")
    assert make_layer_strategy(layer, (4,), ("dp",), zero=True) == \
        make_layer_strategy(layer, (4,), ("dp",), zero=3)
    plain, z3 = layer_space(layer, 4), layer_space(layer, 4, zero=True)
    every = layer_space(layer, 4, zero=(1, 2, 3))
    assert [s for s in every if s.zero == 0] == plain
    assert [s for s in every if s.zero in (0, 3)] == z3
    assert {s.zero for s in every} == {0, 1, 2, 3}
    with pytest.raises(sf.SbpError, match="ZeRO stage"):
        layer_space(layer, 4, zero=5)


def test_evaluate_prices_each_stage():
    """Per device, N = 4 data-parallel ranks, |P| the weights' bytes: data parallelism and
    stages 1 and 2 send 2|P|(N-1)/N (an all-reduce; a reduce-scatter and an all-gather),
    stage 3 3|P|(N-1)/N; stage 1 splits the optimizer state, 2 also the gradients, 3 also
    the weights."""
    g = _graph()
    dp = sf.auto.baselines.data_parallel(g, CLUSTER)
    nbytes = g.params * g.itemsize
    got = {}
    for stage in (0, 1, 2, 3):
        st = Strategy(g, [zero_twin(l, s, stage) for l, s in zip(g.layers, dp.layers)])
        got[stage] = sf.auto.evaluate(g, st, CLUSTER)
    for stage, factor in ((0, 2), (1, 2), (2, 2), (3, 3)):
        assert got[stage].grad_sync_bytes == pytest.approx(factor * nbytes * 3 / 4)
    state = g.optimizer_states * g.optimizer_itemsize / g.itemsize
    for stage, (params, grads, opt) in {0: (1, 1, 1), 1: (1, 1, 4), 2: (1, 4, 4),
                                        3: (4, 4, 4)}.items():
        m = got[stage].memory
        assert m["params"] == pytest.approx(nbytes / params)
        assert m["grads"] == pytest.approx(nbytes / grads)
        assert m["optimizer"] == pytest.approx(nbytes * state / opt)
    assert got[1].time >= got[0].time and got[3].gather_time > 0 == got[1].gather_time


def test_a_search_over_every_stage_is_never_worse_than_over_stage_3():
    """``zero=(1, 2, 3)`` searches a superset of ``zero=True``'s space: exhaustively, its
    answer costs no more; here (GPT, 8 devices, 80 % of the least-time strategy's memory)
    stage 2 (data parallelism's bytes) beats stage 3 (half as much again)."""
    g = model_graphs.gpt(2, 256, 8, 64, 16, 512)
    c = sf.cost.Cluster.preset("dgx-a100", nodes=1, devices_per_node=8)
    free = search(g, c, "exhaustive", memory_limit=float("inf"))
    limit = 0.8 * free.breakdown.memory["total"]
    three = search(g, c, "exhaustive", memory_limit=limit, zero=True)
    every = search(g, c, "exhaustive", memory_limit=limit, zero=(1, 2, 3))
    assert three.fits and every.fits and free.cost < every.cost < three.cost
    assert 2 in {s.zero for s in every.strategy.layers}


# -- parallelize: a searched ZeRO strategy -------------------------------------------------------
GPT = dict(vocab=32, d=32, heads=2, layers=2, seq=8)


def _batch(step: int) -> list:
    g = torch.Generator().manual_seed(step)
    tok = torch.randint(0, GPT["vocab"], (8, GPT["seq"] + 1), generator=g)
    return [tok[:, :-1].contiguous(), torch.arange(GPT["seq"]), tok[:, 1:].contiguous()]


@functools.cache
def _limit() -> float:
    """A memory limit at which the search keeps some layers whole and stores others split
    (70 % of the least-time strategy's memory)."""
    graph, _ = trace(gpt_class(sf.nn, sf.nn.functional)(**GPT).double(), _batch(0))
    free = search(graph, CLUSTER, "exhaustive", memory_limit=float("inf"), zero=True)
    return 0.7 * free.breakdown.memory["total"]


def _searched(limit: float) -> tuple:
    sf.manual_seed(0)
    m = gpt_class(sf.nn, sf.nn.functional)(**GPT).double()
    sd0 = m.state_dict()
    pl = sf.placement("cpu", [0, 1, 2, 3])
    plan = sf.auto.parallelize(m, _batch(0), pl, CLUSTER, memory_limit=limit, zero=True)
    opt = sf.optim.AdamW(m.parameters(), lr=0.02)
    losses = []
    for step in range(2):
        loss = m(*[plan.input(v) for v in _batch(step)])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return sd0, losses, m.state_dict(), plan.strategy, plan.breakdown.memory["total"]


def test_parallelize_runs_a_searched_zero_strategy_under_a_memory_limit():
    limit = _limit()
    res = sf.launch(_searched, 4, args=(limit,))
    sd0, losses, _, strategy, predicted = res[0]
    zero = [s for s in strategy.layers if s.zero]
    assert zero and len(zero) < len(strategy.layers)        # mixed
    assert any(len(s.mesh) == 2 for s in zero)              # ZeRO along one dim of a 2-D mesh
    assert predicted <= limit
    want, want_sd = torch_gpt_train(sd0, GPT, _batch, 2, lr=0.02)   # AdamW's defaults
    for r in res:
        torch.testing.assert_close(torch.tensor(r[1]), torch.tensor(want), rtol=1e-9, atol=0)
        for k, v in want_sd.items():
            torch.testing.assert_close(r[2][k], v, rtol=1e-7, atol=1e-9, msg=k)


def _mixed_2_and_3() -> None:
    m = gpt_class(sf.nn, sf.nn.functional)(**GPT)
    graph, _ = trace(m, _batch(0))
    strategy = Strategy(graph, [make_layer_strategy(l, (2,), ("dp",), zero=2 if i % 2 else 3)
                                for i, l in enumerate(graph.layers)])
    sf.auto.parallelize(m, _batch(0), sf.placement("cpu", [0, 1]), strategy=strategy)


def test_stages_2_and_3_in_one_model_name_the_layers():
    with pytest.raises(sf.SbpError, match="stage 2 on layers .* and stage 3 on layers"):
        sf.launch(_mixed_2_and_3, 2)
