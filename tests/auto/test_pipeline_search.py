"""Pipeline stages in the strategy space (issue 17, part 3): a pipelined strategy's step time
and memory against closed formulas, the search's choice of stages, the table and the command."""

import dataclasses

import pytest

import sbpflow as sf
from sbpflow.auto import model_graphs
from sbpflow.auto.search_cli import pipeline_line
from sbpflow.auto.space import PipelineShape, Strategy, make_layer_strategy
from sbpflow.cli import main

GiB = 2 ** 30
A_IN, B_IN = 3e-6, 1 / 240e9        # intra-node link
A_X, B_X = 1e-5, 1 / 12.5e9          # inter-node link
FLOPS = 1e12


def _cluster(nodes=2, dpn=2, **kw):
    kw.setdefault("memory_per_device", 80 * GiB)
    return sf.cost.Cluster(nodes, dpn, intra=(A_IN, B_IN), inter=(A_X, B_X),
                           flops_per_device=FLOPS, **kw)


def _dp_pipeline(g, cut: int, m: int, schedule: str) -> Strategy:
    """Every layer data parallel on its stage's 2 devices; stage 1 from layer ``cut``."""
    layers = [dataclasses.replace(make_layer_strategy(l, (2,), ("dp",)), stage=int(i >= cut))
              for i, l in enumerate(g.layers)]
    return Strategy(g, layers, PipelineShape(2, 2, m, schedule))


def _chain():
    # tokens 32, itemsize 4: stage 0 = fc0, fc1 (64 -> 64 -> 64), stage 1 = fc2, fc3
    # (64 -> 128 -> 64): stage 1 does twice the work
    return model_graphs.mlp((64, 64, 64, 128, 64), batch=32)


@pytest.mark.parametrize("m", [1, 4])
def test_pipeline_time_is_the_closed_formula(m):
    g, c = _chain(), _cluster()
    b = sf.auto.evaluate(g, _dp_pipeline(g, 2, m, "1f1b"), c)
    # per micro-batch each stage computes 3 x its forward flops, split over 2 devices; no
    # redistribution inside a stage (data parallel throughout)
    work = [2 * 32 * 64 * 64 * 2, 2 * 32 * 64 * 128 * 2]
    slowest = max(3 * f / 2 / FLOPS / m for f in work)
    # one micro-batch of fc1's output (32 x 64 fp32, half a device) from node 0 to node 1 and
    # its gradient back: one message each way over the inter-node link
    half = 32 * 64 * 4 / m / 2
    transfers = 2 * (A_X + half * B_X)
    # gradient all-reduce inside a node, 2 ranks: 2 alpha + n beta per weight; stage 1's
    # weights (2 x 64 x 128) are the larger
    sync = 2 * (2 * A_IN + 64 * 128 * 4 * B_IN)
    want = (m + 2 - 1) * slowest + transfers + sync
    assert b.time == pytest.approx(want, rel=1e-12)
    assert b.stages == 2 and b.micro_batches == m
    assert b.stage_times[1] == pytest.approx(slowest, rel=1e-12)
    assert b.transfer_time == pytest.approx(transfers, rel=1e-12)
    assert b.bubble_time == pytest.approx(slowest, rel=1e-12)
    assert "pipeline: 2 stages" in str(b)


def test_zero_gathers_are_on_every_micro_batch():
    g, c = _chain(), _cluster()
    m = 4
    s = _dp_pipeline(g, 2, m, "1f1b")
    z = Strategy(g, [dataclasses.replace(make_layer_strategy(l, (2,), ("dp",), zero=True),
                                         stage=x.stage) for l, x in zip(g.layers, s.layers)],
                 s.pipeline)
    b = sf.auto.evaluate(g, z, c)
    work = [2 * 32 * 64 * 64 * 2, 2 * 32 * 64 * 128 * 2]
    wbytes = [[64 * 64 * 4] * 2, [64 * 128 * 4] * 2]
    # 2 ranks in a node: all-gather / reduce-scatter of n bytes = alpha + n/2 beta
    half = [[A_IN + n / 2 * B_IN for n in ws] for ws in wbytes]
    micro = [3 * f / 2 / FLOPS / m + 2 * sum(h) for f, h in zip(work, half)]  # fwd + bwd gathers
    sync = max(sum(h) for h in half)                                          # reduce-scatters
    transfers = 2 * (A_X + 32 * 64 * 4 / m / 2 * B_X)
    assert b.time == pytest.approx((m + 1) * max(micro) + transfers + sync, rel=1e-12)
    assert b.gather_time == pytest.approx(2 * m * sum(sum(h) for h in half), rel=1e-12)


def test_1f1b_keeps_s_minus_s_micro_batches_gpipe_all():
    g, c = _chain(), _cluster()
    m = 8
    # per device: params + grads (fp32) + 2 Adam states (fp32) of its stage's weights, and
    # per micro-batch in flight the input and output of each layer (half the tokens)
    weights = [64 * 64 + 64 * 64, 64 * 128 + 128 * 64]
    acts = [(16 * 64 + 16 * 64) * 2, 16 * 64 + 16 * 128 + 16 * 128 + 16 * 64]
    static = [w * 4 * 4 for w in weights]
    per_micro = [a * 4 / m for a in acts]      # one micro-batch: 1/m of the batch's
    one = sf.auto.evaluate(g, _dp_pipeline(g, 2, m, "1f1b"), c).stage_memory
    gp = sf.auto.evaluate(g, _dp_pipeline(g, 2, m, "gpipe"), c).stage_memory
    assert one == pytest.approx([static[0] + 2 * per_micro[0], static[1] + 1 * per_micro[1]])
    assert gp == pytest.approx([static[0] + m * per_micro[0], static[1] + m * per_micro[1]])
    assert PipelineShape(4, 2, 8).in_flight(0) == 4 and PipelineShape(4, 2, 2).in_flight(0) == 2
    assert PipelineShape(4, 2, 8, "gpipe").in_flight(3) == 8


def test_search_picks_stages_when_one_stage_cannot_fit():
    # a GPT-3-like block stack (d_model 12288, 96 heads) on one DGX A100 node: no one-stage
    # strategy fits 80 GB at one micro-batch, a pipeline does
    g = model_graphs.gpt(16, 12288, 96, 2048, 16, 51200)
    c = sf.cost.Cluster.preset("dgx-a100", nodes=1)
    assert sf.auto.pipeline_search.one_stage_floor(g, c) > c.memory_per_device
    r = sf.auto.search(g, c, "cd", restarts=0)
    pp = r.strategy.pipeline
    assert r.fits and pp is not None and pp.stages > 1 and pp.micro_batches >= pp.stages
    assert pp.stages * pp.devices == 8
    assert max(r.breakdown.stage_memory) <= c.memory_per_device
    stages = [s.stage for s in r.strategy.layers]
    assert stages == sorted(stages) and set(stages) == set(range(pp.stages))
    again = sf.auto.evaluate(g, r.strategy, c)
    assert again.time == pytest.approx(r.breakdown.time, rel=1e-12) and r.cost == again.time
    table = r.strategy.table()
    assert table.startswith("stage ") and table.split("\n")[-1].split()[0] == str(pp.stages - 1)
    assert pipeline_line(r.strategy).startswith(f"stages: {pp.stages} x {pp.devices} devices")


def test_search_keeps_one_stage_for_a_model_that_fits():
    g = model_graphs.gpt(2, 256, 8, 128, 8, 512)
    c = sf.cost.Cluster.preset("dgx-a100", nodes=1)
    r = sf.auto.search(g, c, "cd", seed=0, restarts=0)
    one = sf.auto.search(g, c, "cd", seed=0, restarts=0, stages=1)
    assert r.strategy.pipeline is None and r.strategy == one.strategy and r.cost == one.cost
    assert not r.strategy.table().startswith("stage")


def test_search_command_prints_stages(capsys):
    # 19 GiB: the least one-stage memory is 19.5 GiB (GPT-2-style tied head: its weight once)
    argv = ["search", "--model", "gpt", "--layers", "4", "--d-model", "12288", "--heads", "96",
            "--seq", "2048", "--batch", "8", "--vocab", "51200", "--nodes", "1",
            "--cluster", "dgx-a100", "--no-progress", "--algorithm", "exhaustive",
            "--memory-limit", "19", "--schedule", "gpipe"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    line = next(l for l in out.split("\n") if l.startswith("stages:"))
    assert "micro-batches" in line and "schedule gpipe" in line and "stages: 1 " not in line
    assert "\nstage " in out and "pipeline: " in out
    assert main(argv[:-2] + ["--stages", "1"]) == 0
    assert "stages: 1 (no pipeline)" in capsys.readouterr().out


def test_exhaustive_start_only_prunes():
    # the pipeline pass gives the exact search its quick strategies as a bound: same optimum
    from sbpflow.auto.strategy_search import one_stage_search as one_stage
    g = model_graphs.gpt(2, 256, 8, 128, 8, 512)
    c = _cluster(2, 4)
    quick = one_stage(g, c, "cd", restarts=0, window=1)
    a = one_stage(g, c, "exhaustive")
    b = one_stage(g, c, "exhaustive", start=quick.strategy)
    assert a.cost == b.cost and a.strategy == b.strategy
    assert a.cost <= quick.cost
