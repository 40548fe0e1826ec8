"""A GPT whose LM head is tied to its token embedding (``head.weight = tok.weight``), pipelined
over single-rank stages and trained eagerly or as a graph, and its tied torch twin on one device.
Module-level rank function: gloo rank processes import this module by name (no pytest)."""

from __future__ import annotations

import torch

import sbpflow as sf
from sbpflow.models import gpt_class

F64 = torch.float64
GPT = dict(vocab=16, d=8, heads=2, layers=3, seq=6)
STEPS = 3
LR = 0.05


def batch(step: int, n: int) -> tuple:
    """(tokens, positions, targets) of a step."""
    g = torch.Generator().manual_seed(500 + step)
    tok = torch.randint(0, GPT["vocab"], (n, GPT["seq"] + 1), generator=g)
    return tok[:, :-1].contiguous(), torch.arange(GPT["seq"]), tok[:, 1:].contiguous()


def make_opt(params, name: str, nn_module):
    """SGD with momentum or AdamW, in ``nn_module`` (``sf.optim`` or ``torch.optim``)."""
    extra = {} if nn_module is sf.optim else {"foreach": False}
    if name == "sgd":
        return nn_module.SGD(params, lr=LR, momentum=0.9, **extra)
    return nn_module.AdamW(params, lr=LR, weight_decay=0.01, **extra)


class Step(sf.nn.Graph):
    def __init__(self, model, opt, k: int, schedule: str) -> None:
        super().__init__()
        self.model = model
        self.add_optimizer(opt)
        self.config.set_gradient_accumulation_steps(k)
        self.config.set_pipeline_schedule(schedule)
        self.config.set_split_inputs(True, False, True)

    def build(self, x, pos, y):
        loss = self.model(x, pos, y)
        loss.backward()
        return loss


def train_tied(stage_ranks: list, split: list, opt_name: str, k: int = 0,
               schedule: str = "1f1b", n: int = 4, rules=None) -> dict:
    """On every rank: the tied GPT (seed 0) pipelined over ``stage_ranks`` and trained STEPS
    steps, eagerly (``k`` 0) or by a graph of ``k`` micro-batches. Returns the initial and
    final state dicts, the losses, this rank's shard of the tied weight (None if empty), the
    tied parameter's placement ranks and sbp, whether the two modules still share one
    parameter object, and the number of distinct parameters."""
    stages = [sf.placement("cpu", r) for r in stage_ranks]
    everyone = sf.placement("cpu", list(range(sf.comm.world_size())))
    sf.manual_seed(0)
    model = gpt_class(sf.nn, sf.nn.functional)(**GPT).double()
    model.head.weight = model.tok.weight
    sd0 = {key: v.clone() for key, v in model.state_dict().items()}
    sf.parallel.pipeline(model, stages, split=split, rules=rules)
    opt = make_opt(model.parameters(), opt_name, sf.optim)
    step = Step(model, opt, k, schedule) if k else None
    replicated = (sf.B,) * stages[0].ndim
    losses = []
    for i in range(STEPS):
        tok, pos, tgt = batch(i, n)
        x, p, y = (sf.tensor(tok, stages[0], replicated), sf.tensor(pos, stages[0], replicated),
                   sf.tensor(tgt, stages[0], replicated))
        if step is not None:
            loss = step(x, p, y)
        else:
            opt.zero_grad()
            loss = model(x, p, y)
            loss.backward()
            opt.step()
        losses.append(loss.to_global(everyone, (sf.B,)).local.item())
    w = model.tok.weight
    return dict(sd0=sd0, losses=losses, sd=model.state_dict(),
                shard=w.local.clone() if w.local.numel() else None,
                layout=(w.placement.ranks, w.sbp), same=model.head.weight is w,
                nparams=len(list(model.parameters())))


def torch_tied(sd0: dict, opt_name: str, n: int = 4) -> tuple[list, dict]:
    """The tied twin in torch on one device, trained alike: (losses, final state dict)."""
    model = gpt_class(torch.nn, torch.nn.functional)(**GPT).double()
    model.head.weight = model.tok.weight
    model.load_state_dict(sd0)
    opt = make_opt(model.parameters(), opt_name, torch.optim)
    losses = []
    for i in range(STEPS):
        opt.zero_grad()
        loss = model(*batch(i, n))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()
