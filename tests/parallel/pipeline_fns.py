"""The GPT pipeline training run of `test_pipeline`, as a rank function both backends launch
(torch-backend ranks import this module by name: it is cheap to import, no pytest), and its
torch twin on one device."""

from __future__ import annotations

import torch

import sbpflow as sf
from gpt_twin import torch_gpt_train
from sbpflow.models import gpt_class

F64 = torch.float64
# the example (8 blocks split at blocks.2/4/6), narrower so that float64 runs fast
GPT = dict(vocab=32, d=16, heads=2, layers=8, seq=8)
STEPS = 3
LR = 0.01


def batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, positions, targets) of a step: a new batch each step."""
    g = torch.Generator().manual_seed(1000 + step)
    tok = torch.randint(0, GPT["vocab"], (n, GPT["seq"] + 1), generator=g)
    return tok[:, :-1].contiguous(), torch.arange(GPT["seq"]), tok[:, 1:].contiguous()


def train_gpt(stage_ranks: list, split: list, rules, data_sbp, n: int, sbp=None,
              after=None) -> dict:
    """On every rank: the GPT (seed 0) pipelined over ``sf.placement("cpu", r)`` for each
    ``r`` of ``stage_ranks``, trained STEPS steps with AdamW; every input is created on stage 0
    (tokens and targets ``data_sbp``, positions replicated): the pipeline routes them.
    ``after(model)`` is called once the model is pipelined.

    Returns the initial state dict, the losses, the final state dict, each parameter's
    (placement ranks, sbp) and the inputs' placement ranks after the last step."""
    stages = [sf.placement("cpu", r) for r in stage_ranks]
    sf.manual_seed(0)
    model = gpt_class(sf.nn, sf.nn.functional)(**GPT).double()
    sd0 = model.state_dict()
    sf.parallel.pipeline(model, stages, split=split, rules=rules, sbp=sbp)
    if after is not None:
        after(model)
    opt = sf.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    replicated = (sf.B,) * stages[0].ndim
    losses = []
    for step in range(STEPS):
        tok, pos, tgt = batch(step, n)
        x = sf.tensor(tok, stages[0], data_sbp)
        p = sf.tensor(pos, stages[0], replicated)
        y = sf.tensor(tgt, stages[0], data_sbp)
        opt.zero_grad()
        loss = model(x, p, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    layouts = {name: (t.placement.ranks, t.sbp) for name, t in model.named_parameters()}
    inputs = [t.placement.ranks for t in (x, p, y)]
    return dict(sd0=sd0, losses=losses, sd=model.state_dict(), layouts=layouts, inputs=inputs)


def torch_train(sd0: dict, n: int) -> tuple[list, dict]:
    """The same training of the torch twin on one device: (losses, final state dict)."""
    return torch_gpt_train(sd0, GPT, lambda step: batch(step, n), STEPS, LR)
