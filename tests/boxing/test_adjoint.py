"""Backward of boxing is its adjoint: sum_ranks <y, g> == sum_ranks <x, dx> for y = box(x)."""

import pytest
import torch

import sbpflow as sf
from sbptest import nd_sbps, random_local


def _adjoint_gaps(spl, dpl, shape, seed=0):
    """For every (src, dst) layout pair, |<y,g> - <x,dx>| relative to the scale."""
    def body():
        out = []
        for i, src in enumerate(nd_sbps(len(shape), spl.ndim)):
            for j, dst in enumerate(nd_sbps(len(shape), dpl.ndim)):
                x = random_local(shape, spl, src, seed + 100 * i + j).requires_grad_()
                y = x.to_global(dpl, dst)
                g = random_local(shape, dpl, sf.dual_nd(dst), seed + 7 + 100 * i + j)
                y.backward(g)
                assert x.grad.sbp == sf.dual_nd(src)
                out.append((src, dst, float((y.local.detach() * g.local).sum()),
                            float((x.local.detach() * x.grad.local).sum())))
        return out
    per_rank = sf.launch(body, world_size=4)
    gaps = []
    for k, (src, dst, _, _) in enumerate(per_rank[0]):
        lhs = sum(r[k][2] for r in per_rank)
        rhs = sum(r[k][3] for r in per_rank)
        gaps.append((src, dst, abs(lhs - rhs) / (1 + abs(lhs))))
    return gaps


@pytest.mark.parametrize("ranks", [[0, 1], [0, 1, 2], [0, 1, 2, 3], [[0, 1], [2, 3]]])
@pytest.mark.parametrize("shape", [(4, 6), (5, 7)])
def test_adjoint_same_placement(ranks, shape):
    pl = sf.placement("cpu", ranks)
    bad = [g for g in _adjoint_gaps(pl, pl, shape) if g[2] > 1e-10]
    assert not bad, bad[:5]


def test_adjoint_rank3_on_2x2():
    pl = sf.placement("cpu", [[0, 1], [2, 3]])
    bad = [g for g in _adjoint_gaps(pl, pl, (3, 4, 5)) if g[2] > 1e-10]
    assert not bad, bad[:5]


@pytest.mark.parametrize("src,dst", [([0, 1], [2, 3]), ([0, 1, 2, 3], [[0, 1], [2, 3]]),
                                     ([0], [0, 1, 2, 3]), ([0, 1, 2], [1, 2, 3]),
                                     ([[0, 1], [2, 3]], [[0, 2], [1, 3]])])
def test_adjoint_cross_placement(src, dst):
    gaps = _adjoint_gaps(sf.placement("cpu", src), sf.placement("cpu", dst), (5, 7))
    bad = [g for g in gaps if g[2] > 1e-10]
    assert not bad, bad[:5]


def test_gradient_matches_torch_for_a_chain():
    """A chain of layouts, then a weighted sum: the gradient equals torch's on one device."""
    w = torch.randn(6, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def body():
        mesh = sf.placement("cpu", [[0, 1], [2, 3]])
        x = sf.randn(6, 5, placement=mesh, sbp=(sf.S(0), sf.S(1)), seed=3,
                     dtype=torch.float64, requires_grad=True)
        y = x.to_global(sbp=(sf.P, sf.B)).to_global(sf.placement("cpu", [1, 2]), sf.S(1))
        y = y.to_global(mesh, (sf.B, sf.S(0)))
        gw = sf.tensor(w, mesh, (sf.P, sf.S(0)))  # d(sum(w * y))/dy = w, in layout dual(y)
        y.backward(gw)
        return x.grad.full_tensor()
    for g in sf.launch(body, world_size=4):
        assert torch.allclose(g, w)


def test_scalar_backward_seeds():
    def body():
        pl = sf.placement("cpu", [[0, 1], [2, 3]])
        out = []
        for sbp in [(sf.B, sf.B), (sf.P, sf.P), (sf.B, sf.P)]:
            s = sf.full((), 3.0, placement=pl, sbp=sbp, requires_grad=True)
            s.backward()
            assert s.grad.sbp == sf.dual_nd(sbp)
            out.append((s.grad.local.item(), s.grad.full_tensor().item()))
        return out
    res = sf.launch(body, world_size=4)
    for sbp_i, expect_local in enumerate([[1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]]):
        assert [r[sbp_i][0] for r in res] == expect_local
        assert all(r[sbp_i][1] == 1.0 for r in res)


def test_partial_max_is_forward_only():
    def body():
        pl = sf.placement("cpu", [0, 1])
        x = sf.randn(4, placement=pl, sbp=sf.B, seed=0, requires_grad=True)
        y = x.to_global(sbp=sf.P("max"))
        return y.requires_grad, x.to_global(sbp=sf.P).requires_grad
    assert sf.launch(body, world_size=2) == [(False, True)] * 2
