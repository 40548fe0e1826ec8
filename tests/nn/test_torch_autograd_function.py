"""Custom ``torch.autograd.Function``s called with global tensors (sbpflow/nn/torch_autograd.py)
run their own forward and backward on the global tensors: values and input gradients equal
plain torch's (float64) on 4 rank threads in several layouts -- a backward that is not the
forward's derivative (straight-through) included, so the Function's own backward is what ran.
Before, torch ran the forward with grad off and the gradient silently stopped there (BLOOM's
GeLUFunction: half of each block got no gradient)."""

import pytest
import torch

import sbpflow as sf

F64 = torch.float64
S0, S1, B = sf.S(0), sf.S(1), sf.B


class Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.save_for_backward(x)
        ctx.scale = scale
        return x * x * scale

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g * ctx.scale, None


class StraightThrough(torch.autograd.Function):
    """Round forward, identity backward (not the derivative: zero almost everywhere)."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, g):
        return g


class RowMaxAndSum(torch.autograd.Function):
    """Two outputs, one of them integer indices (non-differentiable); the forward reduces
    along axis 0, which a layout may split; the newer setup_context style."""

    @staticmethod
    def forward(x, w):
        values, idx = x.max(dim=0)
        return values * w, idx, (x * w).sum(0)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, w = inputs
        ctx.save_for_backward(x, w, output[1])
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx, g_values, g_idx, g_sum):
        x, w, idx = ctx.saved_tensors
        picked = torch.nn.functional.one_hot(idx, x.shape[0]).T.to(x.dtype)
        gx = picked * (g_values * w) + g_sum * w if ctx.needs_input_grad[0] else None
        gw = (g_values * x.max(dim=0)[0] + (g_sum * x).sum(0)) if ctx.needs_input_grad[1] \
            else None
        return gx, gw


def _program(x, w):
    values, idx, total = RowMaxAndSum.apply(Square.apply(x, 0.5), w)
    out = (values * total).sum() + StraightThrough.apply(x * 3).sum() * 0.25
    return out, idx


G = torch.Generator().manual_seed(7)
X = torch.randn(8, 6, generator=G, dtype=F64)
W = torch.randn(6, generator=G, dtype=F64)


def _torch_reference():
    x, w = X.clone().requires_grad_(), W.clone().requires_grad_()
    out, idx = _program(x, w)
    out.backward()
    return out.detach(), idx, x.grad, w.grad


@pytest.mark.parametrize("layout", [(S0, B), (S1, S0), (B, B)], ids=["S0", "S1", "B"])
def test_custom_function_runs_its_forward_and_backward_on_global_tensors(layout):
    want = _torch_reference()

    def body():
        pl = sf.placement("cpu", [0, 1, 2, 3])
        x = sf.tensor(X, pl, layout[0]).requires_grad_()
        w = sf.tensor(W, pl, layout[1]).requires_grad_()
        out, idx = _program(x, w)
        out.backward()
        return (out.full_tensor(), idx.full_tensor(), idx.requires_grad, x.grad.full_tensor(),
                w.grad.full_tensor(), x.grad.sbp)

    out, idx, idx_grad, gx, gw, gx_sbp = sf.launch(body, world_size=4)[0]
    torch.testing.assert_close(out, want[0], rtol=1e-12, atol=1e-12)
    assert torch.equal(idx, want[1]) and not idx_grad
    torch.testing.assert_close(gx, want[2], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gw, want[3], rtol=1e-12, atol=1e-12)
    assert gx_sbp == (sf.sbp.dual(layout[0]),)    # the gradient layout rule, as for any op


def test_plain_torch_calls_run_torchs_own_apply():
    x = X.clone().requires_grad_()
    Square.apply(x, 2.0).sum().backward()
    torch.testing.assert_close(x.grad, 4 * X)


def test_a_custom_function_in_a_graph_build_is_refused():
    def body():
        pl = sf.placement("cpu", [0, 1])
        lin = sf.nn.Linear(6, 6).double()
        opt = sf.optim.SGD(lin.parameters(), lr=0.1)

        class Step(sf.nn.Graph):
            def __init__(self):
                super().__init__()
                self.lin = lin
                self.add_optimizer(opt)

            def build(self, x):
                loss = StraightThrough.apply(self.lin(x)).sum()
                loss.backward()
                return loss
        with pytest.raises(sf.SbpError, match="StraightThrough cannot be part of a graph"):
            Step()(sf.tensor(X, pl, S0))
    sf.launch(body, world_size=2)


def test_reentrant_checkpoint_of_global_tensors_as_torch():
    """``torch.utils.checkpoint(..., use_reentrant=True)`` (a custom Function whose backward
    keeps plain tensors only) runs as the non-reentrant one: torch's values and gradients, the
    weight used inside included."""
    w0 = torch.randn(6, 6, generator=G, dtype=F64)

    def block(x, w):
        return torch.tanh(x @ w) * x

    def run(x, w):
        return torch.utils.checkpoint.checkpoint(block, x, w, use_reentrant=True).sum()

    x, w = X.clone().requires_grad_(), w0.clone().requires_grad_()
    run(x, w).backward()

    def body():
        pl = sf.placement("cpu", [0, 1, 2, 3])
        gx = sf.tensor(X, pl, S0).requires_grad_()
        gw = sf.tensor(w0, pl, B).requires_grad_()
        out = run(gx, gw)
        out.backward()
        return out.item(), gx.grad.full_tensor(), gw.grad.full_tensor()

    out, gx, gw = sf.launch(body, world_size=4)[0]
    torch.testing.assert_close(torch.tensor(out, dtype=F64), block(X, w0).sum())
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(gw, w.grad)
