"""`sf.parallel.apply` and `sf.auto.parallelize` take a plain ``torch.nn.Module`` and give the
model to call (its `sf.nn.from_torch` conversion; the torch model is left as it was), equal to
the torch model on one device (float64); the costly-layout warning fires through ``apply``."""

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sbpflow as sf
from sbpflow.nn.torch_layouts import CostlyLayoutWarning

F64 = torch.float64


class FusedMLP(nn.Module):
    """A projection whose output the model cuts in two along features (as nanoGPT's c_attn)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 32)
        self.down = nn.Linear(16, 4)

    def forward(self, x):
        a, b = self.up(x).split(16, dim=-1)
        return self.down(F.gelu(a) * b)


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(6, 8, generator=g, dtype=F64), torch.randn(6, 4, generator=g, dtype=F64)


def _torch_steps(model, x, y, steps=2):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def test_apply_takes_a_torch_module_and_returns_the_model_to_call():
    torch.manual_seed(0)
    model = FusedMLP().to(F64)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = _data()

    def body():
        pl = sf.placement("cpu", [0, 1])
        m = sf.parallel.apply(model, pl, {"*": sf.B})
        assert isinstance(m, sf.nn.Module) and m is not model
        opt = sf.optim.SGD(m.parameters(), lr=0.1)
        losses = []
        for _ in range(2):
            loss = ((m(sf.tensor(x, pl, sf.S(0))) - sf.tensor(y, pl, sf.S(0))) ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, m.state_dict()
    got = sf.launch(body, world_size=2)[0]
    for k, v in model.state_dict().items():   # the torch model was left as it was
        assert torch.equal(v, before[k])
    want = _torch_steps(model, x, y)
    assert got[0] == pytest.approx(want[0], rel=1e-12)
    assert list(got[1]) == list(want[1])
    for k in want[1]:
        torch.testing.assert_close(got[1][k], want[1][k], rtol=1e-10, atol=1e-12)


def test_apply_warns_when_the_model_cuts_a_split_projection_again():
    torch.manual_seed(0)
    model = FusedMLP().to(F64)
    x, _ = _data()

    def body():
        pl = sf.placement("cpu", [0, 1])
        m = sf.parallel.apply(model, pl, {"up.*": sf.S(0), "*": sf.B})
        m(sf.tensor(x, pl, sf.B))
    with warnings.catch_warnings(record=True) as caught:   # rank threads warn in this process
        warnings.simplefilter("always")
        sf.launch(body, world_size=2)
    msgs = [str(w.message) for w in caught if issubclass(w.category, CostlyLayoutWarning)]
    assert len(msgs) == 1 and "up.weight" in msgs[0], msgs


def test_parallelize_takes_a_torch_module_and_gives_the_model_to_call():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(F64)
    x, _ = _data()
    want = model(x)

    def body():
        pl = sf.placement("cpu", [0, 1])
        plan = sf.auto.parallelize(model, (sf.tensor(x, pl, sf.B),), pl)
        assert isinstance(plan.model, sf.nn.Module)
        return plan.model(plan.input(x)).full_tensor()
    torch.testing.assert_close(sf.launch(body, world_size=2)[0], want, rtol=1e-12, atol=1e-12)
