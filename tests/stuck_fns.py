"""A rank stuck inside a training step, for the tests of what a timeout names (eager, graph
mode, pipelines; gloo processes and thread ranks). The launched function lives here, cheap to
import (sbpflow and torch only: every gloo rank imports this module by name).

The step's model ends in ``nap``, an op (registered here) whose kernel returns its input, and
on the stuck rank, from the step given on, waits in it instead (a sleep in the rank's own
code: a kernel that never ends) until `wake` is called or a minute has passed. In graph mode
the kernel runs inside the compute actor of the stage that holds it.
"""

from __future__ import annotations

import threading
import time

import torch

import sbpflow as sf
from sbpflow.ops.elementwise import broadcast_split_signatures
from sbpflow.ops.registry import register, tensor_metas
from sbpflow.tensor import apply_op

NAP_OP = "tests.nap"
_NAPPING = {"rank": None, "step": None, "now": -1}
_WAKE = threading.Event()


def _nap(x: torch.Tensor) -> torch.Tensor:
    if sf.comm.rank() == _NAPPING["rank"] and _NAPPING["now"] >= _NAPPING["step"]:
        give_up = time.monotonic() + 60
        while not _WAKE.is_set() and time.monotonic() < give_up:  # (a timeout's message
            time.sleep(0.05)  # shows where the rank is: here, not in threading's code)
    return x.clone()


register(NAP_OP, _nap, lambda *a, **k: broadcast_split_signatures(tensor_metas(a)))


def wake(on: bool = True) -> None:
    """End the naps of thread ranks (a gloo rank is terminated by its launcher); ``False``:
    let the next ones nap again."""
    if on:
        _WAKE.set()
    else:
        _WAKE.clear()


class NapMLP(sf.nn.Module):
    """Linear 6-16, ReLU, Linear 16-8, ReLU, Linear 8-4, then `nap` and cross entropy."""

    def __init__(self) -> None:
        super().__init__()
        nn = sf.nn
        self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(),
                                 nn.Linear(8, 4))

    def forward(self, x, y):
        return sf.nn.functional.cross_entropy(apply_op(NAP_OP, self.net(x)), y)


class _Step(sf.nn.Graph):
    def __init__(self, model, opt) -> None:
        super().__init__()
        self.model = model
        self.add_optimizer(opt)
        self.config.set_gradient_accumulation_steps(2)

    def build(self, x, y):
        loss = self.model(x, y)
        loss.backward()
        return loss


def stuck_step(mode: str, stuck: int, steps: int = 2) -> None:
    """Train `NapMLP` ``steps`` steps on the world, data parallel (``mode`` ``"eager"`` or
    ``"graph"``: an `sf.nn.Graph` of 2 micro-batches) or pipelined one stage a rank, cut at
    ``net.2`` and ``net.4`` (``"pipeline"``, 3 ranks: a graph); rank ``stuck`` naps in the
    last step (in the pipeline it must hold the last stage, where the nap is)."""
    world = sf.comm.world_size()
    _NAPPING.update(rank=stuck, step=steps - 1)
    sf.manual_seed(0)
    model = NapMLP().double()
    if mode == "pipeline":
        stages = [sf.placement("cpu", [r]) for r in range(world)]
        sf.parallel.pipeline(model, stages, split=["net.2", "net.4"])
        pl, sbp = stages[0], sf.B
    else:
        pl, sbp = sf.placement("cpu", list(range(world))), sf.S(0)
        sf.parallel.apply(model, pl, {"*": sf.B})
    opt = sf.optim.SGD(model.parameters(), lr=0.1)
    graph = None if mode == "eager" else _Step(model, opt)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 4, (8,), generator=g)
    for i in range(steps):
        _NAPPING["now"] = i
        gx, gy = sf.tensor(x, pl, sbp), sf.tensor(y, pl, sbp)
        if graph is not None:
            graph(gx, gy)
            continue
        opt.zero_grad()
        model(gx, gy).backward()
        opt.step()
