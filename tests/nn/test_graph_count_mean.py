"""A graph's mean cross-entropy over a split batch (`sbpflow.nn.graph_count_mean`): the replay
guesses the count (no target ignored) instead of waiting for its all-reduce, and corrects a
wrong guess. Against one-device torch in float64: losses and weights over calls whose targets
are all valid (the guess holds), then partly ``ignore_index`` (corrected, guessing stops), on 4
thread ranks; and the same over two micro-batches."""

import torch

import sbpflow as sf

F = sf.nn.functional
STEPS = 4
IGNORED_FROM = 2   # calls from this one have ignored targets


def _data():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(STEPS, 12, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (STEPS, 12), generator=g)
    y[IGNORED_FROM:, ::5] = -100
    w = torch.randn(3, 5, generator=g, dtype=torch.float64)
    return x, y, w


def _reference():
    x, y, w0 = _data()
    w = w0.clone().requires_grad_(True)
    opt = torch.optim.SGD([w], lr=0.5)
    losses = []
    for i in range(STEPS):
        loss = torch.nn.functional.cross_entropy(x[i] @ w.T, y[i])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, w.detach()


class _Step(sf.nn.Graph):
    def __init__(self, lin, opt, k: int) -> None:
        super().__init__()
        self.lin = lin
        self.add_optimizer(opt)
        self.config.set_gradient_accumulation_steps(k)

    def build(self, x, y):
        loss = F.cross_entropy(self.lin(x), y)
        loss.backward()
        return loss


def _run(k: int):
    x, y, w0 = _data()
    pl = sf.placement("cpu", [0, 1, 2, 3])
    lin = sf.nn.Linear(5, 3, bias=False, dtype=torch.float64)
    sf.parallel.apply(lin, pl, {"*": sf.B})
    with torch.no_grad():
        lin.weight.copy_(sf.tensor(w0, pl, sf.B))
    step = _Step(lin, sf.optim.SGD(lin.parameters(), lr=0.5), k)
    losses = []
    for i in range(STEPS):
        loss = step(sf.tensor(x[i], pl, sf.S(0)), sf.tensor(y[i], pl, sf.S(0)))
        losses.append(loss.to_global(pl, sf.B).local.item())
    return losses, lin.weight.full_tensor(), "mean_over_count" in repr(step)


def test_graph_mean_guesses_and_corrects():
    ref_losses, ref_w = _reference()
    for losses, w, recorded in sf.launch(lambda: _run(1), world_size=4):
        assert recorded   # the count is a recorded task, not a boxing and a division
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses),
                                   rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(w, ref_w, rtol=1e-12, atol=1e-12)


def test_two_micro_batches_guess_the_batch_count_and_correct_it():
    """Over micro-batches each divides by its share of the batch's guessed count; the calls
    with ignored targets are corrected at the end of the last backward (more cases in
    tests/graph/test_graph_counted_means.py)."""
    ref_losses, ref_w = _reference()
    for losses, w, recorded in sf.launch(lambda: _run(2), world_size=4):
        assert recorded
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses),
                                   rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(w, ref_w, rtol=1e-12, atol=1e-12)
