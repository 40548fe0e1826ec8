"""Rank functions of the graph-mode tests, launched on thread ranks and on gloo processes (which
import this module by name: keep it cheap to import, no pytest): the example models of
`sbpflow.models` trained eagerly and as an `sf.nn.Graph` from one initial state, the GPT
pipelined and trained as a graph, and its torch twin on one device (float64 everywhere)."""

from __future__ import annotations

import json
import time
from typing import Callable, NamedTuple

import torch

import sbpflow as sf
from gpt_twin import torch_gpt_train
from sbpflow.models import gpt_class, layout, mlp_class, vgg_class, wide_deep_class

F64 = torch.float64
STEPS = 3
LR = 0.01
GPT = dict(vocab=32, d=16, heads=2, layers=4, seq=8)


class TrainStep(sf.nn.Graph):
    """One training step of ``model``: ``loss = model(*inputs)``, ``loss.backward()``, then the
    optimizer; ``builds`` counts the traces of ``build``."""

    def __init__(self, model, opt, k: int = 1, schedule: str = "1f1b",
                 split: tuple | None = None) -> None:
        super().__init__()
        self.model = model
        self.add_optimizer(opt)
        self.config.set_gradient_accumulation_steps(k)
        self.config.set_pipeline_schedule(schedule)
        if split is not None:
            self.config.set_split_inputs(*split)
        self.builds = 0

    def build(self, *inputs):
        self.builds += 1
        loss = self.model(*inputs)
        loss.backward()
        return loss


# -- the example models, small, with their batches ------------------------------------------------
class Example(NamedTuple):
    """``make(nn, F)``: the model in a namespace; ``data(step, n)``: a step's batch of ``n``
    rows as torch tensors; ``batch[i]``: whether input i has the batch on axis 0."""

    make: Callable
    data: Callable
    batch: tuple


def _gen(step: int) -> torch.Generator:
    return torch.Generator().manual_seed(1000 + step)


def gpt_data(step: int, n: int) -> tuple:
    """(tokens, positions, targets) of a step: a new batch each step."""
    tok = torch.randint(0, GPT["vocab"], (n, GPT["seq"] + 1), generator=_gen(step))
    return tok[:, :-1].contiguous(), torch.arange(GPT["seq"]), tok[:, 1:].contiguous()


def _mlp_data(step: int, n: int) -> tuple:
    g = _gen(step)
    return torch.randn(n, 6, generator=g, dtype=F64), torch.randint(0, 4, (n,), generator=g)


def _vgg_data(step: int, n: int) -> tuple:
    g = _gen(step)
    return torch.randn(n, 3, 8, 8, generator=g, dtype=F64), torch.randint(0, 4, (n,), generator=g)


def _wide_deep_data(step: int, n: int) -> tuple:
    g = _gen(step)
    return (torch.randint(0, 40, (n, 3), generator=g), torch.randn(n, 5, generator=g, dtype=F64),
            torch.randint(0, 2, (n,), generator=g))


def _cat(nn):
    return sf.cat if nn is sf.nn else torch.cat


# hidden sizes divisible by 4: every tensor-parallel split of `TP_RULES` is even on 4 ranks
EXAMPLES = {
    "gpt": Example(lambda nn, F: gpt_class(nn, F)(**GPT), gpt_data, (True, False, True)),
    "mlp": Example(lambda nn, F: mlp_class(nn, F)(sizes=(6, 16, 8, 4)), _mlp_data, (True, True)),
    "vgg": Example(lambda nn, F: vgg_class(nn, F)(channels=(3, 4, 8), image=8, classes=4,
                                                  hidden=8), _vgg_data, (True, True)),
    "wide_deep": Example(lambda nn, F: wide_deep_class(nn, F, _cat(nn))(
        vocab=40, dim=4, fields=3, dense=5, hidden=8), _wide_deep_data, (True, True, True)),
}


def _opt(model):
    return sf.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)


def _losses(loss, everyone) -> float:
    """The loss's value on every rank (it may live on the last stage only)."""
    return loss.to_global(everyone, (sf.B,) * everyone.ndim).local.item()


def graph_vs_eager(name: str, layout_name: str, k: int, n, split: bool = False) -> dict:
    """On every rank: the example ``name`` laid out by ``layout_name`` on the world, trained by
    AdamW eagerly (whole batches) and, from the same initial state, by a graph with ``k``
    micro-batches (``split``: the batch inputs named by ``config.set_split_inputs``, else found
    by their size). ``n``: the batch size of each of STEPS steps, or a list of them (one step
    each). Returns per mode its losses, final state dict and optimizer state dict; for the
    graph also the traces of build after each call, ``print(graph)`` and this rank's plan."""
    ex = EXAMPLES[name]
    sizes = [n] * STEPS if isinstance(n, int) else list(n)
    lay = layout(name, layout_name, sf.comm.world_size())
    everyone = sf.placement("cpu", list(range(sf.comm.world_size())))
    replicated = (sf.B,) * lay.placement.ndim
    out = {}
    for mode in ("eager", "graph"):
        sf.manual_seed(0)
        model = ex.make(sf.nn, sf.nn.functional).double()
        sf.parallel.apply(model, lay.placement, lay.rules, zero=lay.zero)
        opt = _opt(model)
        step = TrainStep(model, opt, k, split=ex.batch if split else None) \
            if mode == "graph" else None
        losses, builds = [], []
        for i, rows in enumerate(sizes):
            inputs = [sf.tensor(v, lay.placement, lay.data_sbp if b else replicated)
                      for v, b in zip(ex.data(i, rows), ex.batch)]
            if step is not None:
                loss = step(*inputs)
                builds.append(step.builds)
            else:
                opt.zero_grad()
                loss = model(*inputs)
                loss.backward()
                opt.step()
            losses.append(_losses(loss, everyone))
        out[mode] = dict(losses=losses, sd=model.state_dict(), opt=opt.state_dict(),
                         builds=builds)
        if step is not None:
            out[mode].update(text=str(step), plan=step.plan())
    return out


# -- the GPT pipeline ---------------------------------------------------------------------------
def gpt_pipeline(stage_ranks: list, split: list, rules, data_sbp, n: int, k: int,
                 schedule: str, steps: int = STEPS, files: str | None = None,
                 targets_stage: int = 0) -> dict:
    """On every rank: the GPT (seed 0) pipelined over ``sf.placement("cpu", r)`` for each ``r``
    of ``stage_ranks``, trained ``steps`` steps by a graph of ``k`` micro-batches; inputs on
    stage 0 (tokens and targets ``data_sbp``, positions replicated). Returns the initial state
    dict, the losses, the final state dict, the last call's timeline, the plan and the graph's
    text, the traces of build. ``files``: a directory where every rank calls
    ``save_timeline`` and ``save_trace`` with its own file names (rank 0 writes).
    ``targets_stage``: the stage whose placement the targets are given on."""
    stages = [sf.placement("cpu", r) for r in stage_ranks]
    everyone = sf.placement("cpu", list(range(sf.comm.world_size())))
    sf.manual_seed(0)
    model = EXAMPLES["gpt"].make(sf.nn, sf.nn.functional).double()
    sd0 = model.state_dict()
    sf.parallel.pipeline(model, stages, split=split, rules=rules)
    step = TrainStep(model, _opt(model), k, schedule, split=(True, False, True))
    replicated = (sf.B,) * stages[0].ndim
    losses = []
    for i in range(steps):
        tok, pos, tgt = gpt_data(i, n)
        loss = step(sf.tensor(tok, stages[0], data_sbp), sf.tensor(pos, stages[0], replicated),
                    sf.tensor(tgt, stages[targets_stage], data_sbp))
        losses.append(_losses(loss, everyone))
    if files is not None:
        step.save_timeline(f"{files}/timeline{sf.comm.rank()}.png")
        step.save_trace(f"{files}/trace{sf.comm.rank()}.json")
    return dict(sd0=sd0, losses=losses, sd=model.state_dict(), events=step.timeline(),
                plan=step.plan(), text=str(step), builds=step.builds)


def torch_gpt(sd0: dict, n: int, steps: int = STEPS) -> tuple[list, dict]:
    """The same training of the torch twin on one device: (losses, final state dict)."""
    return torch_gpt_train(sd0, GPT, lambda step: gpt_data(step, n), steps, LR)


# -- failures on gloo processes (returned as data: every rank's outcome is seen) ---------------
def outcome(fn: Callable) -> dict:
    """``fn()``'s result, or its exception as data (its class and base classes' names, message,
    notes), with when it ended."""
    t = time.monotonic()
    try:
        return {"result": fn(), "seconds": time.monotonic() - t}
    except Exception as exc:  # noqa: BLE001 - returned for the test to read
        return {"type": type(exc).__name__, "types": [c.__name__ for c in type(exc).__mro__],
                "message": str(exc),
                "notes": list(getattr(exc, "__notes__", [])), "end": time.time(),
                "seconds": time.monotonic() - t}


def mlp_setup(pipelined: bool):
    """The MLP (sizes 6-16-8-4) on the world: pipelined in one single-rank stage a rank (cut
    at its layers), or data parallel; its graph; the placement and sbp of its inputs."""
    world = sf.comm.world_size()
    sf.manual_seed(0)
    model = EXAMPLES["mlp"].make(sf.nn, sf.nn.functional).double()
    if pipelined:
        stages = [sf.placement("cpu", [r]) for r in range(world)]
        sf.parallel.pipeline(model, stages, split=[f"net.{2 * i}" for i in range(1, world)])
        pl, sbp = stages[0], sf.B
    else:
        pl, sbp = sf.placement("cpu", list(range(world))), sf.S(0)
        sf.parallel.apply(model, pl, {"*": sf.B})
    return TrainStep(model, _opt(model), 2), pl, sbp


def failing_call(pipelined: bool) -> dict:
    """The MLP's graph called twice on 8 rows in 2 micro-batches; the second call's targets
    hold class 7 (of 4) in the last row, which the last rank reads (its rows of the split
    batch, or the last stage). Returns the second call's outcome, after a moment for the
    other ranks to stop (a rank returning from the launched function may be seen by a
    collective of another rank before the abort message is)."""
    step, pl, sbp = mlp_setup(pipelined)
    x, y = EXAMPLES["mlp"].data(0, 8)
    step(sf.tensor(x, pl, sbp), sf.tensor(y, pl, sbp))
    bad = y.clone()
    bad[-1] = 7
    out = outcome(lambda: step(sf.tensor(x, pl, sbp), sf.tensor(bad, pl, sbp)))
    time.sleep(0.2)
    return out


_DONE = "tests.graph.done"  # the message channel the waiting ranks tell the blocked one on


def blocked_rank(pipelined: bool, out_dir: str | None = None) -> dict:
    """The MLP's graph called once by every rank, then again by all but the last rank, which
    blocks instead (run with a small SBPFLOW_TIMEOUT) until each other rank has posted that its
    call ended; those return once all of them have. Returns the second call's outcome (the
    last rank: {}), also written as JSON to ``out_dir``/rank<r>.json when given (gloo: a
    timed-out point-to-point op closes the pair, so the launcher's closing barrier may fail and
    hide the results)."""
    step, pl, sbp = mlp_setup(pipelined)
    x, y = (sf.tensor(v, pl, sbp) for v in EXAMPLES["mlp"].data(0, 8))
    step(x, y)
    comm, last = sf.comm.current(), sf.comm.world_size() - 1
    if comm.rank == last:
        got, deadline = 0, time.monotonic() + 60
        while got < last and time.monotonic() < deadline:
            got += len(comm.inbox(_DONE, 0.05))
        return {}
    out = outcome(lambda: step(x, y))
    for r in range(last + 1):
        if r != comm.rank:
            comm.post(r, _DONE, comm.rank)
    # the waiting ranks return together: one returning while another still waits in the
    # collective would turn that one's timeout into "rank r already returned"
    got, deadline = 0, time.monotonic() + 60
    while got < last - 1 and time.monotonic() < deadline:
        got += len(comm.inbox(_DONE, 0.05))
    if out_dir is not None:
        with open(f"{out_dir}/rank{comm.rank}.json", "w") as f:
            json.dump({k: v for k, v in out.items() if k != "result"}, f)
    return out
