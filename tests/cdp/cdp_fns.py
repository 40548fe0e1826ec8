"""The CDP training runs of `test_cdp_train`, as rank functions both backends launch (torch
ranks import this module by name: cheap to import, no pytest): small float64 stages, batches
drawn from a fixed generator, the trainer's run and the closed-form reference's."""

from __future__ import annotations

import torch

import sbpflow as sf
from sbpflow.parallel.cdp import CyclicDataParallel, closed_form

F64 = torch.float64
WIDTH, CLASSES, LR, MOMENTUM = 5, 3, 0.1, 0.9


def make_stages(n: int) -> list:
    """N stages: Linear + Tanh, the last a Linear to the classes (seeded: the same on every
    rank and in the reference)."""
    sf.manual_seed(0)
    return [sf.nn.Sequential(sf.nn.Linear(WIDTH, WIDTH, dtype=F64), sf.nn.Tanh())
            for _ in range(n - 1)] + [sf.nn.Linear(WIDTH, CLASSES, dtype=F64)]


def loss_fn(out, y):
    return sf.nn.functional.cross_entropy(out, y)


def sgd(params):
    return sf.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def batches(n: int, steps: int = 4) -> list:
    """``steps`` global batches of 2N samples; the last has 2N + 1 (uneven micro-batches)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for s in range(steps):
        b = 2 * n + (1 if s == steps - 1 else 0)
        out.append((torch.randn(b, WIDTH, dtype=F64, generator=g),
                    torch.randint(0, CLASSES, (b,), generator=g)))
    return out


def reference(n: int, rule: str, optimizer=sgd) -> tuple[dict, list]:
    """The closed-form rule on `batches` (run it on one rank)."""
    return closed_form(make_stages(n), loss_fn, optimizer, rule, batches(n))


def train(n: int, rule: str, mode: str, placement=None, optimizer=sgd,
          batch_placement=None) -> dict:
    """On every rank: 3 steps, flush, a 4th step, flush. Returns the state dict, this rank's
    losses, the stats and the losses each call returned. ``batch_placement``: the batches are
    global tensors there (x split S(0), y replicated)."""
    t = CyclicDataParallel(make_stages(n), loss_fn, optimizer, rule=rule, mode=mode,
                           placement=placement)
    data = batches(n)
    if batch_placement is not None:
        data = [(sf.tensor(x, batch_placement, sf.S(0)), sf.tensor(y, batch_placement, sf.B))
                for x, y in data]
    losses = []
    for x, y in data[:3]:
        losses += t.step(x, y)
    losses += t.flush()
    losses += t.step(*data[3])
    losses += t.flush()
    return {"state": t.state_dict(), "losses": losses, "stats": t.stats()}
