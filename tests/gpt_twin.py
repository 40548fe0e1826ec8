"""The one-device torch twin of the tests' GPT training runs (graph mode and pipelines): the
same model class on torch modules, from the sbpflow run's initial state dict, AdamW with
torch's per-parameter kernel. Cheap to import (gloo rank processes import its users by name)."""

from __future__ import annotations

from typing import Callable

import torch

from sbpflow.models import gpt_class


def torch_gpt_train(sd0: dict, cfg: dict, batch: Callable[[int], tuple], steps: int,
                    lr: float, tied: bool = False) -> tuple[list, dict]:
    """Train the float64 torch GPT ``cfg`` from ``sd0`` for ``steps`` steps on ``batch(step)``
    (AdamW, weight decay 0.01): (losses, final state dict). ``tied``: the head uses the token
    embedding's weight."""
    model = gpt_class(torch.nn, torch.nn.functional)(**cfg).double()
    if tied:
        model.head.weight = model.tok.weight
    model.load_state_dict(sd0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, foreach=False)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = model(*batch(step))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()
