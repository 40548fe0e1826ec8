"""`sf.auto.parallelize` runs pipelined strategies (issue 17, part 6): a strategy whose layers
carry stages is laid out stage by stage (stage k on ranks k * devices .., each layer on its mesh
there, `sf.parallel.pipeline` cut at the stage boundaries), and ``plan.graph_step`` trains it as
an ``sf.nn.Graph`` with the strategy's micro-batches and schedule (or eagerly, stages serial): a
GPT on 2 stages x 2 devices equals the one-device torch twin (float64)."""

import dataclasses

import pytest
import torch

import sbpflow as sf
from gpt_twin import torch_gpt_train
from sbpflow.auto.space import PipelineShape, Strategy, make_layer_strategy
from sbpflow.models import gpt_class

B, P, S = sf.B, sf.P, sf.S
GPT = dict(vocab=32, d=16, heads=2, layers=2, seq=8)
STEPS, LR, N = 3, 0.01, 4


def batch(step: int) -> tuple:
    g = torch.Generator().manual_seed(100 + step)
    tok = torch.randint(0, GPT["vocab"], (N, GPT["seq"] + 1), generator=g)
    return tok[:, :-1].contiguous(), torch.arange(GPT["seq"]), tok[:, 1:].contiguous()


def _stages(graph, schedule: str, mid_block: bool = False) -> Strategy:
    """Stage 0 (embeddings, block 0) data parallel on 2 devices; stage 1 (block 1, head)
    Megatron tensor parallel on the other 2; 2 micro-batches. ``mid_block``: stage 1 starts
    at block 0's MLP instead (inside the block's residuals)."""
    layers = []
    for l in graph.layers:
        first = l.name in ("tok", "pos") or l.name.startswith("blocks.0.attn") or \
            (l.name.startswith("blocks.0.") and not mid_block)
        names = ("dp",) if first else (l.attrs["megatron"],)
        s = make_layer_strategy(l, (2,), names)
        layers.append(dataclasses.replace(s, stage=0 if first else 1))
    return Strategy(graph, layers, PipelineShape(2, 2, 2, schedule))


def _train(how: str) -> dict:
    """Train the GPT laid out by parallelize: the hand-made 2-stage strategy run with ``how``
    ("1f1b", "gpipe"; "meta-1f1b": the model built under meta_init; "mid-block": stage 1 cut
    inside block 0; "eager": the model called directly), or ("searched") the strategy the
    search finds with 2 stages."""
    sf.manual_seed(0)
    model = gpt_class(sf.nn, sf.nn.functional)(**GPT).double()
    sd0 = model.state_dict()
    pl = sf.placement("cpu", [0, 1, 2, 3])
    if how.startswith("meta-"):   # built without storage: each rank materialises its shards
        how = how[len("meta-"):]
        sf.manual_seed(0)
        with sf.nn.init.meta_init():
            model = gpt_class(sf.nn, sf.nn.functional)(**GPT).double()
    if how == "searched":   # slow compute: splitting the work pays
        cluster = sf.cost.Cluster.preset("dgx-a100", nodes=1, devices_per_node=4,
                                         flops_per_device=1e9)
        plan = sf.auto.parallelize(model, batch(0), pl, cluster, stages=2)
    else:
        graph, _ = sf.auto.trace(model, batch(0))
        cluster = sf.cost.Cluster.preset("dgx-a100", nodes=1, devices_per_node=4)
        mid = how == "mid-block"
        plan = sf.auto.parallelize(model, batch(0), pl, cluster, strategy=_stages(
            graph, how if how in ("1f1b", "gpipe") else "1f1b", mid))
    opt = sf.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    step = plan.graph_step(opt)
    if how == "eager":   # the model called directly: the stages one after another
        losses = []
        for k in range(STEPS):
            loss = model(*[plan.input(t) for t in batch(k)])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    else:
        losses = [step(*[plan.input(t) for t in batch(k)]).item() for k in range(STEPS)]
    layouts = {n: (p.placement.flat_ranks, p.sbp) for n, p in model.named_parameters()}
    return dict(sd0=sd0, losses=losses, sd=model.state_dict(), layouts=layouts,
                stages=[st.flat_ranks for st in plan.stages], micro=plan.micro_batches,
                schedule=plan.schedule, config=(step.config.micro_batches, step.config.schedule),
                split=plan.pipeline.split, input=plan.placement.flat_ranks, notes=plan.notes,
                time=plan.breakdown.time, bd_stages=plan.breakdown.stages)


@pytest.mark.parametrize("how", ["1f1b", "gpipe", "meta-1f1b", "mid-block", "eager",
                                 "searched"])
def test_a_pipelined_strategy_trains_like_torch(how):
    r = sf.launch(_train, world_size=4, args=(how,))[0]
    assert r["stages"] == [(0, 1), (2, 3)] and r["input"] == (0, 1)
    assert r["bd_stages"] == 2 and r["time"] > 0
    assert r["config"] == (r["micro"], r["schedule"])   # the graph runs the strategy's step
    lay = r["layouts"]
    if how == "searched":   # the search's micro-batches, at most one sample each (notes)
        assert 2 <= r["micro"] <= N and r["schedule"] == "1f1b"
        assert lay["tok.weight"][0] == (0, 1) and lay["head.weight"][0] == (2, 3), lay
    elif how == "mid-block":   # stage 1 moved to block 0's start, and said so
        assert r["split"] == ("blocks.0",) and r["micro"] == 2
        assert lay["blocks.0.mlp.fc.weight"][0] == lay["blocks.0.attn.qkv.weight"][0] == (2, 3)
        assert any("stage 1 from blocks.0.mlp.fc to blocks.0.attn.qkv" in n
                   for n in r["notes"]), r["notes"]
    else:
        assert r["split"] == ("blocks.1",)
        assert r["micro"] == 2 and r["schedule"] == ("gpipe" if how == "gpipe" else "1f1b")
        assert lay["tok.weight"] == ((0, 1), (B,))
        assert lay["blocks.0.mlp.fc.weight"] == ((0, 1), (B,))
        assert lay["blocks.1.attn.qkv.weight"] == ((2, 3), (S(0),))   # column: rows of (out, in)
        assert lay["blocks.1.attn.proj.weight"] == ((2, 3), (S(1),))  # row
        assert lay["head.weight"] == ((2, 3), (S(0),)) and lay["ln_f.weight"] == ((2, 3), (B,))
    want_losses, want_sd = torch_gpt_train(r["sd0"], GPT, batch, STEPS, LR)
    assert r["losses"] == pytest.approx(want_losses, rel=1e-10)
    for k, v in want_sd.items():
        torch.testing.assert_close(r["sd"][k], v, rtol=1e-9, atol=1e-11, msg=k)


def _tied_across_one_device_stages():
    """A tied GPT on two single-device stages (meshes (1,): the stream's owner map of a size-1
    mesh), trained as a graph with AdamW."""
    sf.manual_seed(0)
    model = gpt_class(sf.nn, sf.nn.functional)(**GPT).double()
    model.head.weight = model.tok.weight
    sd0 = {k: v.clone() for k, v in model.state_dict().items()}
    graph, _ = sf.auto.trace(model, batch(0))
    layers = [dataclasses.replace(make_layer_strategy(l, (1,), ("rep",)),
                                  stage=0 if i < len(graph.layers) // 2 else 1)
              for i, l in enumerate(graph.layers)]
    pl = sf.placement("cpu", [0, 1])
    plan = sf.auto.parallelize(model, batch(0), pl,
                               strategy=Strategy(graph, layers, PipelineShape(2, 1, 2)))
    opt = sf.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    step = plan.graph_step(opt)
    losses = [step(*[plan.input(t) for t in batch(k)]).to_global(pl, (B,)).local.item()
              for k in range(STEPS)]
    return graph.ties, sd0, losses, model.tok.weight.to_global(pl, (B,)).local.clone()


def test_a_weight_tied_across_single_device_stages_trains_as_torch():
    ties, sd0, losses, w = sf.launch(_tied_across_one_device_stages, world_size=2)[0]
    assert ties == {"head": "tok"}
    want, sd = torch_gpt_train(sd0, GPT, batch, STEPS, LR, tied=True)
    assert losses == pytest.approx(want, rel=1e-10)
    torch.testing.assert_close(w, sd["tok.weight"], rtol=1e-9, atol=1e-11)
