"""A mean over the targets kept (cross_entropy / nll_loss with ignore_index or class weights)
under gradient accumulation: graph mode refuses it with a GraphError before any update (the
rows' shares would weight the micro-batches wrongly), and the documented sum recipe equals
one-device torch in float64; with no target ignored, the mean equals torch as before."""

import pytest
import torch

import sbpflow as sf

F64 = torch.float64
G = torch.Generator().manual_seed(5)
X = torch.randn(8, 6, dtype=F64, generator=G)
W0 = torch.randn(4, 6, dtype=F64, generator=G)
Y_FULL = torch.tensor([0, 3, 1, 2, 2, 0, 1, 3])
# ignored in micro-batch 0 of both ranks' shards (S(0), each rank cuts its own rows): every
# rank's check fails alike
Y_IGNORED = torch.tensor([0, -100, 1, 2, -100, 0, 1, 3])


def _torch(y: torch.Tensor, steps: int = 2) -> tuple[list, torch.Tensor]:
    w = W0.clone().requires_grad_(True)
    opt = torch.optim.SGD([w], lr=0.5)
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(X @ w.T, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, w.detach()


def _run(y: torch.Tensor, mode: str, k: int = 2, steps: int = 2):
    pl = sf.placement("cpu", [0, 1])
    lin = sf.nn.Linear(6, 4, bias=False, dtype=F64)
    lin.weight = sf.nn.Parameter(sf.tensor(W0, pl, sf.B))
    opt = sf.optim.SGD(lin.parameters(), lr=0.5)
    F = sf.nn.functional

    class Step(sf.nn.Graph):
        def __init__(self):
            super().__init__()
            self.lin = lin
            self.add_optimizer(opt)
            self.config.set_gradient_accumulation_steps(k)
            if mode == "sum":
                self.config.set_loss_reduction("sum")

        def build(self, x, y, kept):
            logits = self.lin(x)
            if mode == "sum":
                loss = F.cross_entropy(logits, y, reduction="sum") / kept
            elif mode == "nll":
                loss = F.nll_loss(F.log_softmax(logits, -1), y)
            elif mode == "weight":
                loss = F.cross_entropy(logits, y, weight=sf.tensor(torch.ones(4, dtype=F64),
                                                                   pl, sf.B))
            else:
                loss = F.cross_entropy(logits, y)
            loss.backward()
            return loss

    step = Step()
    x, t = sf.tensor(X, pl, sf.S(0)), sf.tensor(y, pl, sf.S(0))
    kept = sf.tensor((y != -100).sum().to(F64), pl, sf.B)
    try:
        losses = [step(x, t, kept).item() for _ in range(steps)]
    except sf.SbpError as exc:  # the rank that failed first: GraphError; others: its name
        return "refused", str(exc), lin.weight.full_tensor()
    return losses, None, lin.weight.full_tensor()


@pytest.mark.parametrize("mode", ["mean", "nll"])
def test_ignored_targets_over_micro_batches_are_refused_before_any_update(mode):
    for got, text, w in sf.launch(_run, world_size=2, args=(Y_IGNORED, mode)):
        assert got == "refused" and "ignore_index=-100" in text and "reduction='sum'" in text
        assert torch.equal(w, W0)  # no update


def test_class_weights_over_micro_batches_are_refused_when_compiling():
    got, text, _ = sf.launch(_run, world_size=2, args=(Y_FULL, "weight"))[0]
    assert got == "refused" and "class weights" in text


def test_the_sum_recipe_equals_torch_with_ignored_targets():
    want, w_want = _torch(Y_IGNORED)
    losses, _, w = sf.launch(_run, world_size=2, args=(Y_IGNORED, "sum"))[0]
    assert losses == pytest.approx(want, rel=1e-12, abs=1e-12)
    torch.testing.assert_close(w, w_want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode,k", [("mean", 2), ("nll", 2), ("mean", 1)])
def test_means_with_every_target_kept_equal_torch(mode, k):
    want, w_want = _torch(Y_FULL)
    losses, _, w = sf.launch(_run, world_size=2, args=(Y_FULL, mode, k))[0]
    assert losses == pytest.approx(want, rel=1e-12, abs=1e-12)
    torch.testing.assert_close(w, w_want, rtol=1e-12, atol=1e-12)


def test_one_micro_batch_takes_ignored_targets():
    want, w_want = _torch(Y_IGNORED)
    losses, _, w = sf.launch(_run, world_size=2, args=(Y_IGNORED, "mean", 1))[0]
    assert losses == pytest.approx(want, rel=1e-12, abs=1e-12)
    torch.testing.assert_close(w, w_want, rtol=1e-12, atol=1e-12)
