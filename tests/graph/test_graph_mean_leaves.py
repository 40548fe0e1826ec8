"""The graph's mean cross-entropy (`sbpflow.nn.graph_count_mean`) keeps the leaves its backward
reached from call to call while the parameters it reads stay the same tensors with the same
``requires_grad``: a weight unfrozen between calls, then a wrong guess (targets ignored) whose
correction scales the gradients of the leaves, give one-device torch's losses and weights."""

import torch

import sbpflow as sf

F = sf.nn.functional
STEPS = 5
UNFROZEN_FROM, IGNORED_FROM = 2, 3


def _data():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(STEPS, 8, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (STEPS, 8), generator=g)
    y[IGNORED_FROM:, ::3] = -100
    w1 = torch.randn(4, 5, generator=g, dtype=torch.float64)
    w2 = torch.randn(3, 4, generator=g, dtype=torch.float64)
    return x, y, w1, w2


def _reference():
    x, y, w1, w2 = _data()
    w1, w2 = w1.clone().requires_grad_(False), w2.clone().requires_grad_(True)
    opt = torch.optim.SGD([w1, w2], lr=0.5)
    losses = []
    for i in range(STEPS):
        w1.requires_grad_(i >= UNFROZEN_FROM)
        loss = F_torch_ce(torch.tanh(x[i] @ w1.T) @ w2.T, y[i])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, w1.detach(), w2.detach()


def F_torch_ce(logits, y):
    return torch.nn.functional.cross_entropy(logits, y)


class _Step(sf.nn.Graph):
    def __init__(self, l1, l2, opt) -> None:
        super().__init__()
        self.l1, self.l2 = l1, l2
        self.add_optimizer(opt)

    def build(self, x, y):
        loss = F.cross_entropy(self.l2(self.l1(x).tanh()), y)
        loss.backward()
        return loss


def _run():
    x, y, w1, w2 = _data()
    pl = sf.placement("cpu", [0, 1])
    l1 = sf.nn.Linear(5, 4, bias=False, dtype=torch.float64)
    l2 = sf.nn.Linear(4, 3, bias=False, dtype=torch.float64)
    for lin, w in ((l1, w1), (l2, w2)):
        sf.parallel.apply(lin, pl, {"*": sf.B})
        with torch.no_grad():
            lin.weight.copy_(sf.tensor(w, pl, sf.B))
    step = _Step(l1, l2, sf.optim.SGD([l1.weight, l2.weight], lr=0.5))
    losses = []
    for i in range(STEPS):
        l1.weight.requires_grad_(i >= UNFROZEN_FROM)
        loss = step(sf.tensor(x[i], pl, sf.S(0)), sf.tensor(y[i], pl, sf.S(0)))
        losses.append(loss.to_global(pl, sf.B).local.item())
    return losses, l1.weight.full_tensor(), l2.weight.full_tensor()


def test_cached_leaves_follow_an_unfrozen_weight_and_a_wrong_guess():
    ref_losses, ref_w1, ref_w2 = _reference()
    for losses, w1, w2 in sf.launch(_run, world_size=2):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses),
                                   rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(w1, ref_w1, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(w2, ref_w2, rtol=1e-12, atol=1e-12)
