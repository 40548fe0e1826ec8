"""One call of a graph is one eager training step, whatever else the program does: the MLP of
`graph_fns` on 2 thread ranks (batch split), SGD with momentum, 3 calls, equals the same eager
loop (losses, weights, gradients) with an lr scheduler stepped after the update, a summed loss
over uneven micro-batches, outputs in a dict / tuple with constants, parameters loaded between
calls, no optimizer (gradients accumulate across calls, as eager's), two optimizers, a frozen
weight, a second (evaluation) graph on the same model between calls, and micro-batches
changed after the first call."""

from typing import Any, NamedTuple

import pytest
import torch

import sbpflow as sf
from graph_fns import EXAMPLES

F = sf.nn.functional
EX = EXAMPLES["mlp"]
TOL = dict(rtol=1e-9, atol=1e-12)
CALLS = 3


class _Step(sf.nn.Graph):
    """``cross_entropy(model(x), y, reduction)`` backward; returns the loss, or (``"dict"``) a
    dict of it, twice it, a constant and a namedtuple of it and a string."""

    def __init__(self, model, opts, sch, k: int, reduction: str, out: str) -> None:
        super().__init__()
        self.model = model
        for opt in opts:
            self.add_optimizer(opt, lr_sch=sch)
        self.config.set_gradient_accumulation_steps(k)
        self.config.set_loss_reduction(reduction)
        self.reduction, self.out = reduction, out

    def build(self, x, y):
        return _step(self.model, x, y, self.reduction, self.out)


class _Pair(NamedTuple):   # a namedtuple output comes back as one (it raised a TypeError)
    value: Any
    label: str


def _step(model, x, y, reduction: str, out: str):
    loss = F.cross_entropy(model.net(x), y, reduction=reduction)
    loss.backward()
    if out == "dict":
        return {"loss": loss, "twice": loss * 2.0, "c": 3, "t": _Pair(loss, "x")}
    return loss


class _Logits(sf.nn.Graph):
    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def build(self, x):
        return self.model(x)


def _values(r, pl) -> tuple:
    """Plain values of what a step returned."""
    def v(t):
        return t.to_global(pl, sf.B).local.item()
    if isinstance(r, dict):
        assert type(r["t"]) is _Pair
        return v(r["loss"]), v(r["twice"]), r["c"], v(r["t"][0]), r["t"][1]
    return (v(r),)


def _optimizers(model, case: str) -> list:
    if case == "no optimizer":
        return []
    if case == "two optimizers":  # AdamW on the weights, SGD on the biases
        named = list(model.named_parameters())
        return [sf.optim.AdamW([p for n, p in named if n.endswith("weight")], lr=0.01),
                sf.optim.SGD([p for n, p in named if n.endswith("bias")], lr=0.1,
                             momentum=0.9)]
    if case == "frozen":  # the first layer's weight does not train
        model.net[0].weight.requires_grad_(False)
    return [sf.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1,
                         momentum=0.9)]


def _run(case: str) -> dict:
    """The case's loop eagerly, then from the same state as a graph: per call its values, then
    the final weights and gradients."""
    pl = sf.placement("cpu", [0, 1])
    batches = [tuple(sf.tensor(v, pl, sf.S(0)) for v in EX.data(i, 10)) for i in range(CALLS)]
    reduction = "sum" if case == "sum" else "mean"
    k = 1 if case in ("scheduler", "load", "evaluation", "micro-batches") else 2  # 10 rows:
    # 5 a rank, in 3 + 2
    out = {}
    for mode in ("eager", "graph"):
        sf.manual_seed(0)
        model = EX.make(sf.nn, F).double()
        sf.parallel.apply(model, pl, {"*": sf.B})
        opts = _optimizers(model, case)
        opt = opts[0] if opts else None
        sch = sf.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5) if case == "scheduler" else None
        shape = "dict" if case == "dict" else "loss"
        step = _Step(model, opts, sch, k, reduction, shape)
        logits = _Logits(model)
        vals = []
        for i, (x, y) in enumerate(batches):
            if case == "load" and i == CALLS - 1:  # in place: the graph reads the new values
                model.load_state_dict({n: torch.full_like(t, 0.01 * j) for j, (n, t)
                                       in enumerate(model.state_dict().items())})
            if case == "micro-batches" and i == 1:
                step.config.set_gradient_accumulation_steps(2)
            if mode == "graph":
                vals.append(_values(step(x, y), pl))
            else:  # what the graph runs after build: step(), zero_grad(), lr_sch.step()
                vals.append(_values(_step(model, x, y, reduction, shape), pl))
                for o in opts:
                    o.step()
                    o.zero_grad()
                if sch is not None:
                    sch.step()
            if case == "evaluation":
                vals.append(((logits(x) if mode == "graph" else model(x)).full_tensor(),))
        grads = [None if p.grad is None else p.grad.full_tensor() for p in model.parameters()]
        out[mode] = dict(vals=vals, sd=model.state_dict(), grads=grads,
                         lr=opt.param_groups[0]["lr"] if opt else None)
    return out


@pytest.mark.parametrize("case", ["scheduler", "sum", "dict", "load", "no optimizer",
                                  "two optimizers", "frozen", "evaluation", "micro-batches"])
def test_a_call_is_an_eager_step(case):
    run = sf.launch(_run, world_size=2, args=(case,))[0]
    eager, graph = run["eager"], run["graph"]
    assert len(graph["vals"]) == len(eager["vals"])
    for i, (g, e) in enumerate(zip(graph["vals"], eager["vals"])):
        assert len(g) == len(e)
        for a, b in zip(g, e):
            if isinstance(b, (str, int)):  # the constants returned as traced
                assert a == b and type(a) is type(b), (i, a, b)
            else:
                torch.testing.assert_close(torch.as_tensor(a), torch.as_tensor(b), **TOL,
                                           msg=lambda m: f"call {i}: {m}")
    for k, v in eager["sd"].items():
        torch.testing.assert_close(graph["sd"][k], v, **TOL, msg=lambda m: f"{k}: {m}")
    assert graph["lr"] == eager["lr"]
    if case == "scheduler":
        assert eager["lr"] == 0.1 * 0.5 ** CALLS
    for g, e in zip(graph["grads"], eager["grads"]):
        assert (g is None) == (e is None)
        if e is not None:
            torch.testing.assert_close(g, e, **TOL)
    if case == "no optimizer":  # nothing cleared them: the 3 calls' gradients summed
        assert all(e is not None and e.abs().sum() > 0 for e in eager["grads"])
