"""Megatron-LM configurations as strategies (issue 17, part 5): tensor x pipeline x data
layouts and device counts on a small GPT, the paper's FLOP count, and its Table 1 throughput
predicted by `evaluate` on the calibrated dgx-a100 preset."""

import pytest

import sbpflow as sf
from sbpflow.auto import model_graphs
from sbpflow.auto.baselines import (TABLE1, block_layers, full_recompute, megatron,
                                    megatron_flops, megatron_layers,
                                    megatron_pipeline, megatron_stages, table1_case)
from sbpflow.auto.pipeline_search import explored_counts, micro_batch_ladder, one_stage_floor
from sbpflow.auto.space import splits_sequences

B, P, S = sf.B, sf.P, sf.S


def small():
    g = model_graphs.gpt(layers=4, d_model=64, heads=4, seq=16, batch=8, vocab=128)
    return g, sf.cost.Cluster.preset("dgx-a100", nodes=2)       # 16 devices


ROLES = {"embed": "vocab", "qkv": "col", "attn": "heads", "proj": "row", "fc1": "col",
         "fc2": "row", "head": "col"}
LAYOUTS = {   # Megatron's tensor-parallel (input, weight, output) on the tp dim
    "vocab": (B, S(0), P), "col": (B, S(1), S(1)), "heads": (S(1), None, S(1)),
    "row": (S(1), S(0), P)}


def test_tensor_pipeline_data_layouts_and_devices():
    g, c = small()
    s = megatron(g, c, tp=4, pp=2, dp=2, micro_batches=4)
    assert s.pipeline == sf.auto.PipelineShape(2, 8, 4, "1f1b")
    # two blocks a stage: the embedding with h0, h1; h2, h3 with the head
    assert [st.stage for st in s.layers] == [0] * 11 + [1] * 11
    for layer, st in zip(g.layers, s.layers):
        role = ROLES[layer.name.split(".")[-1]]
        assert st.mesh == (2, 4) and st.names == ("dp", role) and st.devices == 8
        ins, w, out = LAYOUTS[role]
        assert st.input == (S(0), ins)
        assert st.output == (S(0), out)
        assert st.weight == (None if w is None else (B, w))
    b = sf.auto.evaluate(g, s, c)
    assert b.stages == 2 and b.micro_batches == 4 and len(b.stage_times) == 2


def test_one_stage_and_degenerate_sizes():
    g, c = small()
    s = megatron(g, c, tp=2, dp=8)
    assert s.pipeline is None and {st.mesh for st in s.layers} == {(8, 2)}
    assert s["h1.fc2"].names == ("dp", "row") and s["embed"].names == ("dp", "vocab")
    assert megatron(g, c, 4, 1, 4) == megatron(g, c, tp=4)       # dp defaults to the rest
    one = sf.cost.Cluster.preset("dgx-a100", nodes=1)         # 8 devices, 8 sequences
    assert all(st.names == ("dp",) and st.mesh == (8,) for st in megatron(g, one, tp=1).layers)
    t = megatron(g, c, tp=4, pp=4, dp=1)       # a quarter node a stage, tensor parallel only
    assert {st.mesh for st in t.layers} == {(4,)} and t.pipeline.devices == 4
    assert [st.stage for st in t.layers].count(3) == 5 + 1   # h3 and the head


def test_clear_errors():
    g, c = small()
    with pytest.raises(ValueError, match=r"tp 4 x pp 2 x dp 4 != the cluster's 16"):
        megatron(g, c, tp=4, pp=2, dp=4)
    with pytest.raises(ValueError, match=r"tensor parallel size 8 does not divide its 4 heads"):
        megatron(g, c, tp=8, dp=2)
    with pytest.raises(ValueError, match="cannot be cut into 32 pipeline stages"):
        megatron_stages(g, 32)


def test_uneven_stages_balance_flops():
    g, _ = small()
    starts = megatron_stages(g, 3)              # 4 blocks on 3 stages: cut before blocks
    assert starts[0] == 0 and len(starts) == 3
    assert all(g.layers[i].name.endswith(".qkv") for i in starts[1:])


def test_flop_count_is_four_passes_of_blocks_and_three_of_the_head():
    l, h, heads, s, b, v = 3, 96, 4, 32, 6, 1000
    g = model_graphs.gpt(l, h, heads, s, b, v)
    blocks = sum(x.flops for x in g.layers if x.name.startswith("h") and x.name != "head")
    # recomputation runs each block's forward twice; the logit layer is not recomputed
    assert megatron_flops(b, s, l, h, v) == pytest.approx(4 * blocks + 3 * g["head"].flops)


def test_table1_rows_are_the_papers_models():
    for r in TABLE1:
        params = 12 * r.layers * r.hidden ** 2 * (
            1 + 13 / (12 * r.hidden) + (51200 + 2048) / (12 * r.layers * r.hidden))
        assert params / 1e9 == pytest.approx(r.params_b, abs=0.06)
        assert r.tp * r.pp * r.dp == r.gpus and r.heads % r.tp == 0


@pytest.mark.parametrize("params_b", [1.7, 145.6])
def test_predicted_throughput_within_25_percent(params_b):
    row = next(r for r in TABLE1 if r.params_b == params_b)
    case = table1_case(row)
    assert case.breakdown.memory["total"] <= case.cluster.memory_per_device
    assert case.tflops == pytest.approx(row.tflops, rel=0.25)


def test_megatron_pipeline_and_layers_are_megatrons_layout():
    g, c = small()
    assert megatron_pipeline(g, 4, 2, megatron_stages(g, 2), 4) == \
        megatron(g, c, tp=4, pp=2, dp=2, micro_batches=4)
    assert megatron_layers(g, 2, 8) == megatron(g, c, tp=2, dp=8).layers
    cut = megatron_pipeline(g, 2, 4, [0, 3], 2)       # any cut: stage 0 is the embedding, h0
    assert [st.stage for st in cut.layers] == [0] * 3 + [1] * 19
    assert [st.names for st in cut.layers] == [st.names for st in megatron_layers(g, 2, 4)]


def _best_megatron_pipeline(g, c, limit):
    """The least step time of Megatron's configurations the pipeline pass can reach (stage
    counts it explores, tp within a node, micro-batch counts of its ladder keeping whole
    sequences) under ``limit``: (time, tp, stages, micro-batches)."""
    best, heads = None, g.layers[2].attrs["heads"]
    for stages in explored_counts(g, c):
        dev = c.world_size // stages
        for tp in (t for t in range(1, min(dev, 8) + 1) if dev % t == 0 and heads % t == 0):
            for m in micro_batch_ladder(g, stages):
                s = megatron(g, c, tp, stages, dev // tp, m)
                if any(splits_sequences(l, x, m) for l, x in zip(g.layers, s.layers)):
                    continue
                b = sf.auto.evaluate(g, s, c)
                if max(b.stage_memory) <= limit and (best is None or b.time < best[0]):
                    best = (b.time, tp, stages, m)
    return best


@pytest.mark.parametrize("d_model, seq, batch", [(256, 128, 32), (512, 256, 64)])
def test_search_is_no_worse_than_megatrons_best_pipeline(d_model, seq, batch):
    # one stage cannot fit 90 % of its least memory, so the pipeline pass runs; its quick
    # stage searches alone found 1.59x and 1.05x the best Megatron pipeline here (data
    # parallel stages at more micro-batches): Megatron's layouts seed it
    g = model_graphs.gpt(8, d_model, 8, seq, batch, 4 * d_model)
    c = sf.cost.Cluster.preset("dgx-a100", nodes=2)
    limit = 0.9 * one_stage_floor(g, c)
    best = _best_megatron_pipeline(g, c, limit)
    assert best is not None
    r = sf.auto.search(g, c, memory_limit=limit)
    assert r.fits and r.strategy.pipeline is not None
    assert r.breakdown.time <= best[0] * (1 + 1e-9)


def test_full_recompute_is_the_blocks_forward_once_more():
    # Megatron's full activation recomputation: every transformer-block layer (not the
    # embedding, not the head) keeps only its input and runs its forward again in backward
    g, c = small()
    names = [l.name for i, l in enumerate(g.layers) if i in set(block_layers(g))]
    assert names == [f"h{b}.{x}" for b in range(4) for x in ("qkv", "attn", "proj", "fc1", "fc2")]
    for pp, m in ((1, 1), (2, 4)):
        plain = megatron(g, c, tp=4, pp=pp, micro_batches=m)
        rc = megatron(g, c, tp=4, pp=pp, micro_batches=m, recompute=True)
        assert rc == full_recompute(plain) and rc.pipeline == plain.pipeline
        assert [s.recompute for s in rc.layers] == [n in names for n in (l.name for l in g.layers)]
        a, b = sf.auto.evaluate(g, plain, c), sf.auto.evaluate(g, rc, c)
        for l in g.layers:   # forward + backward is 3 forwards; recomputation adds one
            ratio = b.per_layer[l.name]["compute"] / a.per_layer[l.name]["compute"]
            assert ratio == pytest.approx(4 / 3 if l.name in names else 1.0)
        assert b.time > a.time and b.memory["activations"] < a.memory["activations"]


def test_table1_cases_recompute_as_the_paper_ran():
    row = TABLE1[4]
    case, plain = table1_case(row), table1_case(row, recompute=False)
    assert all(s.recompute == (l.name not in ("embed", "head")) for l, s in
               zip(case.graph.layers, case.strategy.layers))
    assert not any(s.recompute for s in plain.strategy.layers)
    assert case.breakdown.time > plain.breakdown.time
    # the 1T row fits an 80 GB A100 as it did in the paper's run (not without recomputation)
    big = table1_case(TABLE1[9])
    assert max(big.breakdown.stage_memory) <= big.cluster.memory_per_device
    assert max(table1_case(TABLE1[9], recompute=False).breakdown.stage_memory) > \
        big.cluster.memory_per_device


@pytest.mark.slow
def test_search_beats_table1_row0_by_5_percent():
    # issue 17 part 5(b) on the smallest row (the benchmark runs rows 0-6): the default search
    # under the same 80 GiB is <= 0.95x Megatron's configuration as the paper ran it
    case = table1_case(TABLE1[0])
    limit = case.cluster.memory_per_device
    r = sf.auto.search(case.graph, case.cluster, memory_limit=limit)
    assert r.fits and r.breakdown.time <= 0.95 * case.breakdown.time
    assert not any(s.recompute for s in r.strategy.layers)
