"""Torch functions with no rule of their own run as their decompositions into ops with rules
(sbpflow/nn/torch_decomposed.py): composite functions under autograd, torch's decomposition
tables for values only (their derivative is not always the op's own); values and gradients equal
plain torch's, nothing gathered where the decomposition's ops gather nothing; in graphs too."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import sbpflow as sf
from sbpflow.nn.torch_fallback import ReplicatedFallbackWarning

F64 = torch.float64
G = torch.Generator().manual_seed(11)
X = torch.randn(8, 6, generator=G, dtype=F64)
Y = torch.rand(8, 6, generator=G, dtype=F64) + 0.5
W = torch.randn(128, generator=G, dtype=F64)  # weights of the loss: every output matters

# composite functions: torch's autograd goes through the same decomposition
COMPOSITE = {
    "diff": lambda x, y: torch.diff(x, dim=1),
    "kron": lambda x, y: torch.kron(x[:, :2], y[:2, :3]),
    "kl_div": lambda x, y: F.kl_div(F.log_softmax(x, 1), y, reduction="batchmean"),
    "softmin": lambda x, y: F.softmin(x, dim=1),
    "cosine_embedding_loss": lambda x, y: F.cosine_embedding_loss(
        x, y, torch.tensor([1, -1] * 4)),
    "outer": lambda x, y: torch.outer(x[:, 0], y[0]),
    "matrix_power 0": lambda x, y: torch.linalg.matrix_power(x[:6], 0),  # eye copied over a
    # clone: in the graph still, as in torch (gradient 0)
}
# ops torch ships a decomposition for (torch._decomp): gather-free without autograd
TABLE = {
    "rot90": lambda x, y: torch.rot90(x, 1, (0, 1)),
    "addr": lambda x, y: torch.addr(x, y[:, 0], y[0]),
    "huber_loss": lambda x, y: F.huber_loss(x, y, delta=0.5),
    "hardswish": lambda x, y: F.hardswish(x),
}


def _weights(shape) -> torch.Tensor:
    return W.reshape(-1)[:torch.Size(shape).numel()].reshape(shape)


def _run(calls: dict, mesh, sbp, grad: bool) -> dict:
    pl = sf.placement("cpu", mesh)
    out = {}
    for name, fn in calls.items():
        x = sf.tensor(X, pl, sbp).requires_grad_(grad)
        y = sf.tensor(Y, pl, sbp)
        sf.comm.reset_stats()
        with torch.set_grad_enabled(grad):
            r = fn(x, y)
        gathered = sf.comm.stats()["fallback"].recv
        if grad:
            (r * sf.tensor(_weights(r.shape), pl, (sf.B,) * pl.ndim)).sum().backward()
        out[name] = (r.full_tensor(), x.grad.full_tensor() if grad else None, gathered)
    return out


def _torch(fn, grad: bool):
    x = X.clone().requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        want = fn(x, Y)
    if grad:
        (want * _weights(want.shape)).sum().backward()
    return want.detach(), x.grad


LAYOUTS = [([0, 1, 2, 3], sf.S(0)), ([[0, 1], [2, 3]], (sf.S(0), sf.S(1)))]


@pytest.mark.parametrize("mesh,sbp", LAYOUTS, ids=["S0", "2x2"])
def test_composite_functions_run_as_their_ops_with_torchs_gradients_gathering_nothing(mesh, sbp):
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReplicatedFallbackWarning)  # no call may gather
        got = sf.launch(_run, 4, args=(COMPOSITE, mesh, sbp, True))[0]
    for name, fn in COMPOSITE.items():
        want, grad = _torch(fn, True)
        value, g, gathered = got[name]
        torch.testing.assert_close(value, want, msg=name)
        torch.testing.assert_close(g, grad, msg=name)
        assert gathered == 0, name


def test_decomposition_tables_serve_values_and_autograd_runs_the_op_replicated():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReplicatedFallbackWarning)
        values = sf.launch(_run, 4, args=(TABLE, [0, 1, 2, 3], sf.S(0), False))[0]
        graded = sf.launch(_run, 4, args=(TABLE, [0, 1, 2, 3], sf.S(0), True))[0]
    for name, fn in TABLE.items():
        want, _ = _torch(fn, False)
        torch.testing.assert_close(values[name][0], want, msg=name)
        assert values[name][2] == 0, name   # decomposed: nothing gathered
        want, grad = _torch(fn, True)
        torch.testing.assert_close(graded[name][0], want, msg=name)
        torch.testing.assert_close(graded[name][1], grad, msg=name)
        assert graded[name][2] > 0, name    # the op itself, on the gathered inputs


def _safe_softmax():
    pl = sf.placement("cpu", [0, 1])
    x = sf.tensor(_MASKED, pl, sf.S(0)).requires_grad_()
    r = torch.ops.aten._safe_softmax.default(x, 1)
    (r * sf.tensor(_weights(r.shape), pl, sf.B)).sum().backward()
    return r.full_tensor(), x.grad.full_tensor()


_MASKED = X.clone()
_MASKED[2] = float("-inf")  # a row masked whole: _safe_softmax gives 0 and gradient 0


def test_an_ops_own_derivative_is_kept_where_its_decomposition_has_another():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReplicatedFallbackWarning)
        value, grad = sf.launch(_safe_softmax, 2)[0]
    x = _MASKED.clone().requires_grad_()
    want = torch.ops.aten._safe_softmax.default(x, 1)
    (want * _weights(want.shape)).sum().backward()
    torch.testing.assert_close(value, want.detach())
    torch.testing.assert_close(grad, x.grad)   # the decomposition's would be nan in row 2
    assert not grad.isnan().any()


class _Step(sf.nn.Graph):
    def build(self, x, y):
        return torch.diff(x, dim=1) * F.softmin(y, dim=1)[:, 1:]


def _in_a_graph():
    pl = sf.placement("cpu", [0, 1])
    step = _Step()
    x, y = sf.tensor(X, pl, sf.S(0)), sf.tensor(Y, pl, sf.S(0))
    first = step(x, y).full_tensor()
    sf.comm.reset_stats()
    second = step(x * 2, y).full_tensor()
    return first, second, sf.comm.stats()["fallback"].recv


def test_a_graph_records_a_decomposition_and_replays_it():
    first, second, gathered = sf.launch(_in_a_graph, 2)[0]
    torch.testing.assert_close(first, torch.diff(X, dim=1) * F.softmin(Y, dim=1)[:, 1:])
    torch.testing.assert_close(second, torch.diff(X * 2, dim=1) * F.softmin(Y, dim=1)[:, 1:])
    assert gathered == 0
