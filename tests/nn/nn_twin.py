"""Shared by the tests of sf.nn / sf.optim / checkpoints: a small MLP, its torch.nn twin, the
parallel layouts it is trained in, and a training loop run both ways."""

from __future__ import annotations

import torch

import sbpflow as sf

F64 = torch.float64
IN, HID, OUT, BATCH = 5, 10, 3, 6  # uneven over 4 ranks on purpose

# name -> (mesh ranks, input nd-sbp, parameter rules)
LAYOUTS = {
    "dp": ([0, 1, 2, 3], sf.S(0), {"*": sf.B}),
    "tp": ([0, 1, 2, 3], sf.B, {"0.weight": sf.S(0), "0.bias": sf.S(0), "2.weight": sf.S(1),
                                "*": sf.B}),
    "hybrid": ([[0, 1], [2, 3]], (sf.S(0), sf.B),
               {"0.weight": (sf.B, sf.S(0)), "0.bias": (sf.B, sf.S(0)),
                "2.weight": (sf.B, sf.S(1)), "*": (sf.B, sf.B)}),
    "zero": ([0, 1, 2, 3], sf.S(0), {"*": sf.S(0)}),
    "replicated": ([0, 1, 2, 3], sf.B, {"*": sf.B}),
}

OPTIMIZERS = {
    "sgd": (lambda ps: sf.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True),
            lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01,
                                       nesterov=True)),
    "adam": (lambda ps: sf.optim.Adam(ps, lr=0.02, weight_decay=0.01),
             lambda ps: torch.optim.Adam(ps, lr=0.02, weight_decay=0.01, foreach=False)),
    "adamw": (lambda ps: sf.optim.AdamW(ps, lr=0.02, betas=(0.8, 0.99), amsgrad=True),
              lambda ps: torch.optim.AdamW(ps, lr=0.02, betas=(0.8, 0.99), amsgrad=True,
                                           foreach=False)),
    # multi-tensor kernels (sf's default is torch's fused kernel)
    "adam-foreach": (lambda ps: sf.optim.Adam(ps, lr=0.02, weight_decay=0.01, fused=False),
                     lambda ps: torch.optim.Adam(ps, lr=0.02, weight_decay=0.01, foreach=False)),
    # one parameter at a time
    "adamw-single": (lambda ps: sf.optim.AdamW(ps, lr=0.02, weight_decay=0.05, foreach=False),
                     lambda ps: torch.optim.AdamW(ps, lr=0.02, weight_decay=0.05,
                                                  foreach=False)),
}
MAX_NORM = 0.5  # small enough that clipping is active in some steps


def sf_mlp(dropout: float = 0.0) -> "sf.nn.Module":
    layers = [sf.nn.Linear(IN, HID, dtype=F64), sf.nn.ReLU(), sf.nn.Linear(HID, OUT, dtype=F64)]
    if dropout:
        layers.insert(2, sf.nn.Dropout(dropout))
    return sf.nn.Sequential(*layers)


def torch_mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(IN, HID), torch.nn.ReLU(),
                               torch.nn.Linear(HID, OUT)).to(F64)


def batch(step: int, n: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, IN, generator=g, dtype=F64), torch.randn(n, OUT, generator=g, dtype=F64)


def layout(name: str):
    ranks, x_sbp, rules = LAYOUTS[name]
    return sf.placement("cpu", ranks), x_sbp, rules


def sf_loss(model, pl, x_sbp, x_full, t_full):
    x = sf.tensor(x_full, pl, x_sbp)
    t = sf.tensor(t_full, pl, x_sbp)
    return ((model(x) - t) ** 2).mean()


def torch_loss(model, x, t):
    return ((model(x) - t) ** 2).mean()


def sf_train(model, opt, pl, x_sbp, steps, first_step: int = 0, clip: bool = True):
    """Runs inside a rank: ``steps`` steps; returns (losses, grad norms)."""
    losses, norms = [], []
    for step in range(first_step, first_step + steps):
        opt.zero_grad()
        loss = sf_loss(model, pl, x_sbp, *batch(step))
        loss.backward()
        if clip:
            norms.append(float(sf.optim.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        losses.append(loss.item())
    return losses, norms


def torch_train(model, opt, steps, first_step: int = 0, clip: bool = True):
    losses, norms = [], []
    for step in range(first_step, first_step + steps):
        opt.zero_grad()
        loss = torch_loss(model, *batch(step))
        loss.backward()
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        losses.append(loss.item())
    return losses, norms


def assert_close(a, b, what: str = "", rtol: float = 1e-7, atol: float = 1e-10) -> None:
    a, b = torch.as_tensor(a, dtype=F64), torch.as_tensor(b, dtype=F64)
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")
