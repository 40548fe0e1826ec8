"""`sf.auto.parallelize` runs a strategy whose tied layers (a GPT's LM head tied to its token
embedding) are in different pipeline stages: the weight is one parameter on the tie placement
(the two layer placements stacked, ``B`` across them: a copy in each stage, their gradients
all-reduced by the optimizer), given by hand or searched with stages=2; 3 AdamW / SGD steps as a
graph (1F1B, GPipe) and eagerly equal the tied torch model on one device (float64). A tie whose
layers' meshes cannot hold one layout raises `ParallelizeError` (tests/parallel/test_pipeline_tied.py
checks the refusals of `sf.parallel.pipeline`)."""

import dataclasses

import pytest
import torch

import sbpflow as sf
from sbpflow.auto.space import PipelineShape, Strategy, make_layer_strategy
from sbpflow.models import gpt_class

GPT = dict(vocab=16, d=8, heads=2, layers=2, seq=6)
STEPS, LR, N = 3, 0.05, 4
TOL = dict(rtol=1e-9, atol=1e-10)


def batch(step: int) -> tuple:
    g = torch.Generator().manual_seed(300 + step)
    tok = torch.randint(0, GPT["vocab"], (N, GPT["seq"] + 1), generator=g)
    return tok[:, :-1].contiguous(), torch.arange(GPT["seq"]), tok[:, 1:].contiguous()


def _opt(params, name: str, module):
    extra = {} if module is sf.optim else {"foreach": False}
    if name == "sgd":
        return module.SGD(params, lr=LR, momentum=0.9, **extra)
    return module.AdamW(params, lr=LR, weight_decay=0.01, **extra)


def _tied(nn, F):
    model = gpt_class(nn, F)(**GPT).double()
    model.head.weight = model.tok.weight
    return model


def _two_stages(graph, schedule: str) -> Strategy:
    """Embeddings and block 0 on stage 0, block 1 and the head on stage 1, two devices each,
    replicated; 2 micro-batches."""
    layers = []
    for l in graph.layers:
        first = l.name in ("tok", "pos") or l.name.startswith("blocks.0.")
        s = make_layer_strategy(l, (2,), ("rep",))
        layers.append(dataclasses.replace(s, stage=0 if first else 1))
    return Strategy(graph, layers, PipelineShape(2, 2, 2, schedule))


def _train(how: str, opt_name: str) -> dict:
    sf.manual_seed(0)
    model = _tied(sf.nn, sf.nn.functional)
    sd0 = {k: v.clone() for k, v in model.state_dict().items()}
    pl = sf.placement("cpu", [0, 1, 2, 3])
    cluster = sf.cost.Cluster.preset("dgx-a100", nodes=1, devices_per_node=4,
                                     flops_per_device=1e6)   # slow compute: stages pay off
    if how == "searched":
        plan = sf.auto.parallelize(model, batch(0), pl, cluster, stages=2)
    else:
        graph, _ = sf.auto.trace(model, batch(0))
        plan = sf.auto.parallelize(model, batch(0), pl, cluster,
                                   strategy=_two_stages(graph, "gpipe" if how == "gpipe"
                                                        else "1f1b"))
    opt = _opt(model.parameters(), opt_name, sf.optim)
    step = plan.graph_step(opt)
    losses = []
    for k in range(STEPS):
        inputs = [plan.input(t) for t in batch(k)]
        if how == "eager":
            loss = model(*inputs)
            loss.backward()
            opt.step()
            opt.zero_grad()
        else:
            loss = step(*inputs)
        losses.append(loss.to_global(pl, (sf.B,)).local.item())
    w = model.tok.weight
    stage = {l.name: s.stage for l, s in zip(plan.graph.layers, plan.strategy.layers)}
    return dict(sd0=sd0, losses=losses, sd=model.state_dict(), shard=w.local.clone(),
                layout=(w.placement.ranks, w.sbp), same=model.head.weight is w,
                stages=(stage["tok"], stage["head"]), nstages=len(plan.stages))


def _torch(sd0: dict, opt_name: str) -> tuple:
    model = _tied(torch.nn, torch.nn.functional)
    model.load_state_dict(sd0)
    opt = _opt(model.parameters(), opt_name, torch.optim)
    losses = []
    for k in range(STEPS):
        opt.zero_grad()
        loss = model(*batch(k))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()


@pytest.mark.parametrize("how,opt", [("1f1b", "adamw"), ("gpipe", "sgd"), ("eager", "adamw"),
                                     ("searched", "adamw")])
def test_tied_layers_in_two_stages_train_as_torch(how, opt):
    results = sf.launch(_train, world_size=4, args=(how, opt))
    r = results[0]
    assert r["nstages"] == 2 and r["stages"] == (0, 1), r["stages"]   # the tie spans the stages
    assert r["layout"][0] == [[0, 1], [2, 3]] and r["layout"][1][0] == sf.B and r["same"]
    for a, b in ((0, 2), (1, 3)):   # each stage's copy: the same shards on the same coordinates
        assert torch.equal(results[a]["shard"], results[b]["shard"])
    t_losses, t_sd = _torch(r["sd0"], opt)
    torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(t_losses), **TOL)
    for k, v in t_sd.items():
        torch.testing.assert_close(r["sd"][k], v, **TOL, msg=lambda m: f"{k}: {m}")
        assert not torch.equal(v, r["sd0"][k]), f"{k} was not trained"
