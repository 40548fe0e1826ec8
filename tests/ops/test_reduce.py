"""Reductions (sum, mean, amax, amin): every signature on a 1-D mesh of 3 and the 2x2 mesh equals
torch, forward and gradients, with uneven sizes; partial outputs need no communication."""

import pytest
import torch

import sbpflow as sf
from sbpflow.sbp import Partial, Split
from sbpflow.tensor import apply_op
from sbptest import check_op, signature_layouts

MESHES = [[0, 1, 2], [[0, 1], [2, 3]]]
TORCH = {"sum": torch.sum, "mean": torch.mean,
         "amax": lambda t, d=None, k=False: torch.amax(t, () if d is None else d, k),
         "amin": lambda t, d=None, k=False: torch.amin(t, () if d is None else d, k)}


def _t(*shape, seed=0):
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _run(name, shape, dim, keepdim, ranks):
    """All signatures' input layouts, with gradients except for P(max)/P(min) inputs (no
    gradient; forward only). An amax of a split reduced axis on an input that requires grad
    keeps the gradient (the registry avoids the detaching P(max) then), which is checked too."""
    x = _t(*shape)
    pl = sf.placement("cpu", ranks)
    args = (x, dim, keepdim)
    layouts = signature_layouts(name, args, pl)

    def no_grad(lay):
        return any(isinstance(s, Partial) and s.op != "sum" for s in lay[0])
    with_grad = [lay for lay in layouts if not no_grad(lay)]
    without = [lay for lay in layouts if no_grad(lay)]

    def body():
        fn = lambda t, d, k: apply_op(name, t, d, k)  # noqa: E731
        return (check_op(fn, TORCH[name], args, pl, with_grad)
                + check_op(fn, TORCH[name], args, pl, without, grad=False))
    failures = sf.launch(body, world_size=pl.size)[0]
    assert not failures, failures[:5]
    return layouts


@pytest.mark.parametrize("ranks", MESHES)
@pytest.mark.parametrize("name", ["sum", "mean", "amax", "amin"])
@pytest.mark.parametrize("shape,dim,keepdim", [((5, 7), 1, False), ((5, 7), None, False),
                                               ((3, 5, 7), (0, 2), True), ((3, 5, 7), -2, False)])
def test_reduction_every_signature(ranks, name, shape, dim, keepdim):
    layouts = _run(name, shape, dim, keepdim, ranks)
    pl = sf.placement("cpu", ranks)
    # every axis split on some mesh dim, and the partial kind, are among the checked layouts
    axes = {s.axis for lay in layouts for s in lay[0] if isinstance(s, Split)}
    assert axes == set(range(len(shape)))
    want = sf.P if name in ("sum", "mean") else sf.P(name[1:])
    assert any(want in lay[0] for lay in layouts) and len(layouts) == (len(shape) + 2) ** pl.ndim


@pytest.mark.parametrize("name", ["sum", "mean"])
def test_sum_mean_dims_and_empty_tuple(name):
    for dim, keepdim in [((), False), ([1, 0], True), (0, True)]:
        _run(name, (4, 5), dim, keepdim, [0, 1, 2])


def test_partial_outputs_move_no_bytes_and_max_is_detached():
    def body():
        mesh = sf.placement("cpu", [[0, 1], [2, 3]])
        x = sf.randn(5, 7, placement=mesh, sbp=(sf.S(0), sf.S(1)), seed=0, dtype=torch.float64,
                     requires_grad=True)
        full = x.full_tensor().detach()
        sf.comm.reset_stats()
        s, m = x.sum(0), x.mean(dim=(0, 1))
        mx, mn = x.detach().amax(1, keepdim=True), x.detach().amin()
        sent = sf.comm.stats().sent
        ok = [torch.allclose(s.full_tensor(), full.sum(0)),
              torch.allclose(m.full_tensor(), full.mean()),
              torch.allclose(mx.full_tensor(), full.amax(1, keepdim=True)),
              torch.allclose(mn.full_tensor(), full.amin())]
        m.backward()
        grad_ok = torch.allclose(x.grad.full_tensor(), torch.full((5, 7), 1 / 35, dtype=torch.float64))
        # with an input that requires grad, the max keeps its gradient (no detaching P(max))
        g = x.amax(1, keepdim=True)
        return (s.sbp, m.sbp, mx.sbp, mn.sbp, sent, ok, mx.requires_grad, s.requires_grad,
                grad_ok, g.requires_grad, g.sbp)
    s, m, mx, mn, sent, ok, mx_grad, s_grad, grad_ok, g_grad, g_sbp = \
        sf.launch(body, world_size=4)[0]
    assert s == (sf.P, sf.S(0)) and m == (sf.P, sf.P)
    assert mx == (sf.S(0), sf.P("max")) and mn == (sf.P("min"), sf.P("min"))
    assert sent == 0 and all(ok) and grad_ok
    assert not mx_grad and s_grad and g_grad and sf.P("max") not in g_sbp


def test_mean_divides_by_the_logical_count():
    """An uneven split: each rank's part of the mean is its local sum over the LOGICAL count."""
    def body():
        pl = sf.placement("cpu", [0, 1, 2])
        x = sf.tensor(torch.arange(4.0, dtype=torch.float64).reshape(4, 1), pl, sf.S(0))
        m = x.mean(0)
        return m.sbp, m.local.item(), m.full_tensor().item()
    res = sf.launch(body, world_size=3)
    assert [r[0] for r in res] == [(sf.P,)] * 3
    assert [r[1] for r in res] == [pytest.approx(v / 4) for v in (0 + 1, 2, 3)]
    assert all(r[2] == pytest.approx(1.5) for r in res)


def test_invalid_inputs_raise_sbp_errors():
    def body():
        pl = sf.placement("cpu", [0, 1])
        x = sf.randn(5, 7, placement=pl, sbp=sf.B, seed=0)
        errors = []
        try:  # amax of a partial sum is not a valid signature
            apply_op("amax", x, 0, sbp=[(sf.P,)])
        except sf.errors.SignatureError as e:
            errors.append(str(e))
        try:
            x.sum(2)
        except sf.ShapeError as e:
            errors.append(str(e))
        try:
            x.mean((0, 0))
        except sf.SbpError as e:
            errors.append(str(e))
        return errors
    e1, e2, e3 = sf.launch(body, world_size=2)[0]
    assert "amax" in e1 and "(5, 7)" in e1 and "P" in e1
    assert "sum" in e2 and "(5, 7)" in e2
    assert "mean" in e3 and "(5, 7)" in e3
