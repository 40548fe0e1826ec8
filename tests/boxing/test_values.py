"""Boxing keeps the logical value exactly, for every pair of layouts."""

import itertools
import random

import pytest
import torch

import sbpflow as sf
from sbptest import int_tensor, make_global, nd_sbps

SHAPES = {1: [(8,), (5,)], 2: [(4, 8), (5, 7)], 3: [(4, 2, 6), (3, 5, 7)]}


def _check_all_pairs(placement, shapes, partial_ops, sample=None):
    """Every (src, dst) pair of layouts, or ``sample`` of them drawn with a fixed seed."""
    def body():
        failures = []
        for shape in shapes:
            full = int_tensor(shape, seed=len(shape))
            layouts = nd_sbps(len(shape), placement.ndim, partial_ops)
            pairs = list(itertools.product(layouts, layouts))
            if sample is not None:
                pairs = random.Random(0).sample(pairs, sample)
            for src, dst in pairs:
                x = make_global(full, placement, src)
                y = x.to_global(sbp=dst)
                got = y.full_tensor()
                if not torch.equal(got, full):
                    failures.append((shape, src, dst))
                assert y.shape == full.shape and y.sbp == tuple(dst)
        return failures
    results = sf.launch(body, world_size=placement.size)
    assert results[0] == [], f"value changed for {results[0][:5]}"


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_1d_all_pairs(n, ndim):
    _check_all_pairs(sf.placement("cpu", list(range(n))), SHAPES[ndim], ("sum", "max", "min"))


@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_2x2_all_pairs(ndim):
    _check_all_pairs(sf.placement("cpu", [[0, 1], [2, 3]]), SHAPES[ndim], ("sum",))


def test_2x2_size_one_and_empty_shards():
    """Splitting an axis of size 1 (or 2 over 4 ranks) leaves empty shards on some ranks."""
    _check_all_pairs(sf.placement("cpu", [[0, 1], [2, 3]]), [(1, 2, 8), (2, 1)], ("sum",))


def test_2x2_partial_max_pairs():
    _check_all_pairs(sf.placement("cpu", [[0, 1], [2, 3]]), [(5, 7)], ("max",))


def test_2x3_mesh_and_3d_mesh():
    _check_all_pairs(sf.placement("cpu", [[0, 1, 2], [3, 4, 5]]), [(5, 7)], ("sum",))


def test_2x2x2_mesh():
    _check_all_pairs(sf.placement("cpu", [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]), [(6, 5)], ("sum",),
                     sample=300)


CROSS = [
    ([0, 1], [2, 3]),
    ([0, 1, 2, 3], [[0, 1], [2, 3]]),
    ([[0, 1], [2, 3]], [0, 1, 2, 3]),
    ([0], [0, 1, 2, 3]),
    ([0, 1, 2, 3], [3]),
    ([0, 1, 2], [1, 2, 3]),             # overlapping ranks
    ([[0, 1], [2, 3]], [[3, 2], [1, 0]]),  # same ranks, another order
    ([[0, 1], [2, 3]], [[0, 2], [1, 3]]),
]


@pytest.mark.parametrize("src_ranks,dst_ranks", CROSS)
def test_cross_placement_all_pairs(src_ranks, dst_ranks):
    spl, dpl = sf.placement("cpu", src_ranks), sf.placement("cpu", dst_ranks)

    def body():
        bad = []
        for shape in [(4, 6), (5, 7)]:
            full = int_tensor(shape, seed=3)
            for src in nd_sbps(2, spl.ndim):
                for dst in nd_sbps(2, dpl.ndim):
                    x = make_global(full, spl, src)
                    y = x.to_global(dpl, dst)
                    if not torch.equal(y.full_tensor(), full):
                        bad.append((shape, src, dst))
                    if sf.rank() not in dpl:
                        assert y.local.numel() == 0
        return bad
    assert sf.launch(body, world_size=4)[0] == []


def test_issue_example():
    def main():
        mesh = sf.placement("cpu", ranks=[[0, 1], [2, 3]])
        x = sf.randn(6, 10, placement=mesh, sbp=(sf.S(0), sf.S(1)), seed=0)
        y = x.to_global(sbp=(sf.B, sf.S(0)))
        z = y.to_global(placement=sf.placement("cpu", ranks=[2, 3]), sbp=sf.S(1))
        assert torch.equal(z.full_tensor(), x.full_tensor())
        p = sf.boxing.plan(x.shape, x.dtype, src=(x.placement, x.sbp), dst=(mesh, (sf.B, sf.B)))
        return str(p)
    text = sf.launch(main, world_size=4)[0]
    assert "all_gather" in text and "720 B" in text


def test_uneven_round_trip_keeps_sizes():
    def body():
        pl = sf.placement("cpu", [0, 1, 2, 3])
        x = sf.randn(1023, 1025, placement=pl, sbp=sf.S(0), seed=5)
        y = x.to_global(sbp=sf.B).to_global(sbp=sf.S(0))
        assert tuple(y.local.shape) == tuple(x.local.shape)
        assert torch.equal(y.local, x.local)
        z = x.to_global(sbp=sf.S(1))
        assert z.local.shape == (1023, [257, 256, 256, 256][sf.rank()])
        return tuple(y.shape)
    assert sf.launch(body, world_size=4) == [(1023, 1025)] * 4


def test_float32_and_int_dtypes():
    def body():
        pl = sf.placement("cpu", [[0, 1], [2, 3]])
        for dtype in (torch.float32, torch.int64, torch.bfloat16):
            full = int_tensor((5, 6), 1, dtype)
            for src, dst in [((sf.P, sf.S(1)), (sf.B, sf.B)), ((sf.S(0), sf.S(1)), (sf.S(1), sf.P))]:
                y = make_global(full, pl, src).to_global(sbp=dst)
                assert y.dtype == dtype
                assert torch.equal(y.full_tensor(), full)
    sf.launch(body, world_size=4)


def test_zero_size_and_scalar():
    def body():
        pl = sf.placement("cpu", [0, 1, 2])
        for shape, sbp in [((0, 4), sf.S(0)), ((2, 4), sf.S(0)), ((), sf.B)]:
            full = int_tensor(shape, 2)
            for dst in ([sf.B, sf.P] if shape == () else [sf.B, sf.S(1), sf.P]):
                y = make_global(full, pl, sbp).to_global(sbp=dst)
                assert torch.equal(y.full_tensor(), full)
    sf.launch(body, world_size=3)


def test_tiles_needs_exact_single_cover():
    from sbpflow.boxing.boxes import tiles
    region = ((0, 4), (0, 6))
    halves = [((0, 2), (0, 6)), ((2, 2), (0, 6))]
    assert tiles(halves, region)
    assert not tiles(halves[:1], region)                                  # a gap
    assert not tiles(halves + [((1, 1), (0, 6))], region)                 # an overlap
    # equal volume, but one part twice and another never (a dual's routes can do this)
    assert not tiles([((0, 2), (0, 6)), ((0, 2), (0, 6))], region)
    assert not tiles([((0, 2), (0, 6)), ((2, 2), (0, 7))], region)        # outside the region


def test_joins_and_stacked_axis():
    """When received pieces are their region back to back (no copy needed), or slabs of one
    axis (one cat): exact cases, including empty pieces and the wrong order."""
    from sbpflow.boxing.boxes import joins, stacked_axis
    region = ((0, 8), (0, 6))
    rows = [((0, 2), (0, 6)), ((2, 2), (0, 6)), ((4, 4), (0, 6))]
    assert joins(rows, region) and stacked_axis(rows, region) == 0
    assert not joins(rows[::-1], region) and stacked_axis(rows[::-1], region) is None
    assert not joins(rows[:2], region) and stacked_axis(rows[:2], region) is None  # a gap
    cols = [((0, 8), (0, 3)), ((0, 8), (3, 3))]
    assert not joins(cols, region) and stacked_axis(cols, region) == 1
    # a row's halves then the other rows: consecutive runs, but no one axis
    runs = [((0, 1), (0, 3)), ((0, 1), (3, 3)), ((1, 7), (0, 6))]
    assert joins(runs, region) and stacked_axis(runs, region) is None
    assert not joins([((0, 1), (0, 3)), ((0, 1), (3, 2)), ((1, 7), (0, 6))], region)
    empty = [((0, 0), (0, 6)), ((0, 8), (0, 6)), ((8, 0), (0, 6))]
    assert joins(empty, region) and stacked_axis(empty, region) == 0
    inner = ((2, 4), (1, 3))  # a region not at the origin
    assert joins([((2, 1), (1, 3)), ((3, 3), (1, 3))], inner)
    assert not joins([((2, 4), (1, 1)), ((2, 4), (2, 2))], inner)
    assert stacked_axis([((2, 4), (1, 1)), ((2, 4), (2, 2))], inner) == 1
