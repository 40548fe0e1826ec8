"""A stage replayed as one generated program (`sbpflow.graph.replay`) equals eager mode bit for
bit, and the walk over the tasks (``SBPFLOW_GRAPH_PROGRAM=0``) too: a training step with a
random draw, dropout, an in-place write into a buffer, a part under ``no_grad``, a detach, an
op of two outputs and a boxing step inside the stage (2 thread ranks, 3 SGD steps)."""

import pytest
import torch

import sbpflow as sf
from sbpflow.graph import plan as graph_plan
from sbpflow.graph import replay as program

STEPS = 3


class Net(sf.nn.Module):
    def __init__(self, pl):
        super().__init__()
        self.fc = sf.nn.Linear(8, 8)
        self.out = sf.nn.Linear(8, 4)
        self.register_buffer("seen", sf.zeros(8, placement=pl, sbp=sf.B))

    def forward(self, x):
        h = sf.nn.functional.dropout(self.fc(x), p=0.25, training=True)
        noise = sf.randn(*h.shape, placement=h.placement, sbp=h.sbp)
        h = h + 0.01 * noise
        with torch.no_grad():
            self.seen += h.detach().sum(0).to_global(sbp=sf.B)
        top, idx = h.max(dim=1)
        return self.out(h.relu()) * top.unsqueeze(1) + idx.unsqueeze(1) * 0.0


def _run(use_graph: bool) -> dict:
    pl = sf.placement("cpu", [0, 1])
    sf.manual_seed(0)
    net = sf.parallel.apply(Net(pl), pl, {"*": sf.B})
    opt = sf.optim.SGD(net.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    data = [(sf.tensor(torch.randn(6, 8, generator=g), pl, sf.S(0)),
             sf.tensor(torch.randn(6, 4, generator=g), pl, sf.S(0))) for _ in range(STEPS)]

    def loss_of(x, y):
        return ((net(x) - y) ** 2).mean()

    class Step(sf.nn.Graph):
        def __init__(self):
            super().__init__()
            self.net = net
            self.add_optimizer(opt)

        def build(self, x, y):
            loss = loss_of(x, y)
            loss.backward()
            return loss
    step = Step()
    losses = []
    sf.manual_seed(2)
    for x, y in data:
        if use_graph:
            losses.append(step(x, y).full_tensor())
        else:
            loss = loss_of(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.full_tensor())
    sd = {k: getattr(v, "full_tensor", v.clone)() for k, v in net.state_dict().items()}
    return {"losses": losses, "sd": sd}


def _same(a: dict, b: dict) -> None:
    for x, y in zip(a["losses"], b["losses"]):
        assert torch.equal(x, y), (x, y)
    assert set(a["sd"]) == set(b["sd"])
    for k, v in a["sd"].items():
        assert torch.equal(v, b["sd"][k]), k


def test_program_equals_eager_and_the_walk(monkeypatch):
    made = []
    real = program.segment_program

    def spy(nodes, frees, label="segment"):
        fn = real(nodes, frees, label)
        made.append(fn.source)
        return fn
    monkeypatch.setattr(graph_plan, "segment_program", spy)
    eager = sf.launch(_run, world_size=2, args=(False,))
    graph = sf.launch(_run, world_size=2, args=(True,))
    assert len(made) == 2   # one program a rank, made once, replayed every call
    src = made[0]
    # the kernels, the draw, the boxing step, the in-place write and the detach are its own
    # lines: no task of this graph runs by the walk's fallback
    assert "_apply_step(" in src and "seed_counter" in src and ".copy_(" in src
    assert ".detach()" in src and ".run(vals" not in src
    monkeypatch.setenv("SBPFLOW_GRAPH_PROGRAM", "0")
    walked = sf.launch(_run, world_size=2, args=(True,))
    assert len(made) == 2
    for r in range(2):
        _same(graph[r], eager[r])
        _same(walked[r], graph[r])


def test_program_raises_the_error_eager_raises():
    """An op's torch error in a replay is the one the op's rule gives in eager mode."""
    def run():
        pl = sf.placement("cpu", [0])

        class Bad(sf.nn.Graph):
            def build(self, x, i):
                return x[i]
        x = sf.tensor(torch.arange(4.0), pl, sf.B)
        g = Bad()
        g(x, sf.tensor(torch.tensor([1]), pl, sf.B))
        with pytest.raises(Exception) as got:
            g(x, sf.tensor(torch.tensor([7]), pl, sf.B))
        with pytest.raises(Exception) as eager:
            x[sf.tensor(torch.tensor([7]), pl, sf.B)]
        return type(got.value), type(eager.value)
    got, eager = sf.launch(run, world_size=1)[0]
    assert got is eager
