"""Compute in every cost (issue 17, part 2): redundant work is charged, a cluster without
``flops_per_device`` prices compute at the documented default speed, evaluate reports compute
per layer, and VGG-13 keeps its convolutions data parallel."""

import pytest

import sbpflow as sf
from sbpflow.auto import model_graphs
from sbpflow.auto.space import make_layer_strategy

B, P, S = sf.B, sf.P, sf.S


def test_compute_per_device_counts_redundant_work():
    g = model_graphs.mlp((64, 128, 32), batch=32, activation=False)
    lin = g["fc1"]            # accepts a partial input
    c = sf.cost.Cluster(1, 4, intra=(1e-6, 1e-10), inter=(1e-6, 1e-10), flops_per_device=1e12)
    ev = sf.auto.Evaluator(g, c)
    full = 3 * lin.flops / 1e12
    cases = {("dp",): 4, ("col",): 4, ("row",): 4, ("rep",): 1, ("pin",): 1}
    for names, split in cases.items():
        s = make_layer_strategy(lin, (4,), names)
        assert ev.node_terms(lin, s)["compute"] == pytest.approx(full / split), names
    # a 2-D mesh: data parallel on one dim, replicated on the other: half the devices' work
    s = make_layer_strategy(lin, (2, 2), ("dp", "rep"))
    assert ev.node_terms(lin, s)["compute"] == pytest.approx(full / 2)


def test_default_device_speed_and_compute_per_layer():
    g = model_graphs.gpt(1, 64, 4, 16, 8, 128)
    c = sf.cost.Cluster(1, 4, intra=(1e-6, 1e-10), inter=(1e-6, 1e-10))   # no flops given
    assert c.flops_per_device is None and c.device_flops == sf.cost.DEFAULT_FLOPS_PER_DEVICE
    s = sf.auto.baselines.megatron(g, c, tp=4)
    b = sf.auto.evaluate(g, s, c)
    per = {n: v["compute"] for n, v in b.per_layer.items()}
    assert sum(per.values()) == pytest.approx(b.compute_time) and b.compute_time > 0
    assert per["h0.fc1"] == pytest.approx(3 * g["h0.fc1"].flops / 4 / c.device_flops)
    # a replicated strategy costs the whole work on every device
    rep = sf.auto.Strategy(g, [make_layer_strategy(l, (4,), ("rep",)) for l in g.layers])
    assert sf.auto.evaluate(g, rep, c).compute_time == pytest.approx(4 * b.compute_time)


def _convs_data_parallel(result, p):
    for layer, s in result.strategy.items():
        if layer.startswith("conv"):
            assert s.input[0] == S(0) and s.mesh == (p,), (layer, s)


def test_vgg13_keeps_convolutions_data_parallel_without_flops():
    """Before compute was always priced, VGG-13 on 16 single-GPU nodes without
    ``flops_per_device`` ran its first convolutions replicated (free redundant work)."""
    g = model_graphs.vgg13(512)
    c = sf.cost.Cluster.preset("supercomputer", nodes=16, flops_per_device=None)
    r = sf.auto.search(g, c)
    _convs_data_parallel(r, 16)
    assert r.breakdown.compute_time > 0
