"""Boxing in real processes: torch.distributed with gloo (a representative subset)."""

import itertools

import pytest
import torch

import sbpflow as sf
from sbptest import int_tensor, make_global, nd_sbps

pytestmark = pytest.mark.gloo


def _values_and_bytes():
    """Value preservation and planned bytes, same placement and across placements."""
    bad = []
    line, mesh = sf.placement("cpu", [0, 1, 2, 3]), sf.placement("cpu", [[0, 1], [2, 3]])
    pairs = [(line, line, s, d) for s, d in itertools.product(nd_sbps(2, 1, ("sum", "max")), repeat=2)]
    pairs += [(mesh, mesh, s, d) for s, d in itertools.product(nd_sbps(2, 2), repeat=2)]
    for spl, dpl in [([0, 1], [2, 3]), ([0, 1, 2, 3], [[0, 1], [2, 3]]), ([0], [0, 1, 2, 3])]:
        spl, dpl = sf.placement("cpu", spl), sf.placement("cpu", dpl)
        pairs += [(spl, dpl, s, d) for s in nd_sbps(2, spl.ndim) for d in nd_sbps(2, dpl.ndim)]
    sent = []
    for shape in [(5, 7), (8, 12)]:
        full = int_tensor(shape, 1)
        for spl, dpl, s, d in pairs:
            x = make_global(full, spl, s)
            sf.comm.reset_stats()
            y = x.to_global(dpl, d)
            sent.append(sf.comm.stats().sent)
            if not torch.equal(y.full_tensor(), full):
                bad.append((shape, str(spl), s, str(dpl), d))
    return bad, sent, pairs


def _adjoint_and_grad():
    mesh = sf.placement("cpu", [[0, 1], [2, 3]])
    x = sf.randn(6, 5, placement=mesh, sbp=(sf.S(0), sf.S(1)), seed=3, dtype=torch.float64,
                 requires_grad=True)
    y = x.to_global(sbp=(sf.P, sf.B)).to_global(sf.placement("cpu", [1, 2]), sf.S(1))
    w = torch.arange(30, dtype=torch.float64).reshape(6, 5)
    y.backward(sf.tensor(w, y.placement, sf.B))
    return x.grad.full_tensor()


def _uneven_round_trip():
    pl = sf.placement("cpu", [0, 1, 2, 3])
    x = sf.randn(1023, 1025, placement=pl, sbp=sf.S(0), seed=5)
    y = x.to_global(sbp=sf.B).to_global(sbp=sf.S(0))
    return torch.equal(y.local, x.local), tuple(y.local.shape)


def _permuted_and_fresh():
    """Every 1-D transition on a placement whose ranks are out of order (the gathered buffer
    is not in group order) and on one in order (it is the result): values bit-equal, and a
    result never shares memory with its input (writing it leaves the input as it was)."""
    bad = []
    for ranks in ([2, 0, 3, 1], [0, 1, 2, 3]):
        pl = sf.placement("cpu", ranks)
        for shape in [(9, 6), (8, 12), (3, 5)]:
            full = int_tensor(shape, 7)
            for s, d in itertools.product([sf.S(0), sf.S(1), sf.B, sf.P], repeat=2):
                x = make_global(full, pl, s)
                before = x.local.clone()
                y = x.to_global(sbp=d)
                if not torch.equal(y.full_tensor(), full):
                    bad.append((ranks, shape, s, d, "value"))
                if s == d or s == sf.B or d == sf.P:  # no collective: a view is torch's too
                    continue
                y.local.add_(1)
                if not torch.equal(x.local, before):
                    bad.append((ranks, shape, s, d, "aliased"))
    return bad


def test_permuted_group_and_fresh_results_over_gloo():
    for bad in sf.launch(_permuted_and_fresh, world_size=4, backend="torch"):
        assert bad == [], bad[:5]


def test_values_and_bytes_over_gloo():
    res = sf.launch(_values_and_bytes, world_size=4, backend="torch")
    assert res[0][0] == [], res[0][0][:5]
    pairs = res[0][2]
    shapes = [(5, 7), (8, 12)]
    k = 0
    for shape in shapes:
        for spl, dpl, s, d in pairs:
            planned = sf.boxing.plan(shape, torch.float64, (spl, s), (dpl, d)).nbytes
            assert sum(r[1][k] for r in res) == planned, (shape, s, d)
            k += 1


def test_gradient_and_uneven_over_gloo():
    grads = sf.launch(_adjoint_and_grad, world_size=4, backend="torch")
    for g in grads:
        assert torch.equal(g, torch.arange(30, dtype=torch.float64).reshape(6, 5))
    assert sf.launch(_uneven_round_trip, world_size=4, backend="torch") == \
        [(True, (256, 1025)), (True, (256, 1025)), (True, (256, 1025)), (True, (255, 1025))]
