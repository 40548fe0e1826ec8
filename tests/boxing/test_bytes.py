"""The bytes the Communicator counts when a plan runs equal the plan's cost."""

import itertools

import pytest
import torch

import sbpflow as sf
from sbptest import int_tensor, make_global, nd_sbps


def _measure(spl, dpl, pairs, shape, dtype=torch.float32):
    def body():
        full = int_tensor(shape, 0, dtype)
        out = []
        for src, dst in pairs:
            x = make_global(full, spl, src)
            sf.comm.reset_stats()
            x.to_global(dpl, dst)
            st = sf.comm.stats()
            out.append((st.sent, st.recv))
        return out
    per_rank = sf.launch(body, world_size=4)
    for k, (src, dst) in enumerate(pairs):
        plan = sf.boxing.plan(shape, dtype, (spl, src), (dpl, dst))
        sent = sum(r[k][0] for r in per_rank)
        recv = sum(r[k][1] for r in per_rank)
        assert sent == recv == plan.nbytes, (src, dst, sent, recv, str(plan))


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("shape", [(8, 12), (5, 7)])
def test_every_1d_transition(n, shape):
    pl = sf.placement("cpu", list(range(n)))
    layouts = nd_sbps(2, 1, ("sum", "max"))
    _measure(pl, pl, list(itertools.product(layouts, layouts)), shape)


def test_1d_costs_follow_the_table():
    """OneFlow's table on 4 ranks, |T| = 8*12*4 bytes."""
    pl = sf.placement("cpu", [0, 1, 2, 3])
    T = 8 * 12 * 4
    expect = {(sf.S(0), sf.S(1)): 3 * T // 4, (sf.S(0), sf.B): 3 * T, (sf.P, sf.S(0)): 3 * T,
              (sf.P, sf.B): 6 * T, (sf.B, sf.S(0)): 0, (sf.B, sf.P): 0, (sf.S(1), sf.P): 0}
    for (s, d), cost in expect.items():
        p = sf.boxing.plan((8, 12), torch.float32, (pl, s), (pl, d))
        assert p.nbytes == cost, str(p)
    kinds = {(sf.S(0), sf.S(1)): "all_to_all", (sf.S(0), sf.B): "all_gather",
             (sf.P, sf.S(0)): "reduce_scatter", (sf.P, sf.B): "all_reduce"}
    for (s, d), kind in kinds.items():
        steps = sf.boxing.plan((8, 12), torch.float32, (pl, s), (pl, d)).steps
        assert [st.kind for st in steps] == [kind]


MESH = [[0, 1], [2, 3]]
ND_PAIRS = [((sf.S(0), sf.S(1)), (sf.B, sf.B)), ((sf.P, sf.P), (sf.B, sf.B)),
            ((sf.S(0), sf.S(1)), (sf.S(1), sf.S(0))), ((sf.P, sf.S(0)), (sf.S(0), sf.S(1))),
            ((sf.S(0), sf.S(0)), (sf.B, sf.S(0))), ((sf.B, sf.P), (sf.S(1), sf.B)),
            ((sf.P, sf.B), (sf.B, sf.S(1))), ((sf.S(1), sf.B), (sf.P, sf.P))]


@pytest.mark.parametrize("shape", [(8, 12), (5, 7)])
def test_nd_transitions(shape):
    pl = sf.placement("cpu", MESH)
    _measure(pl, pl, ND_PAIRS, shape)
    all_pairs = list(itertools.product(nd_sbps(2, 2), nd_sbps(2, 2)))
    _measure(pl, pl, all_pairs, shape)


def test_nd_plans_are_minimal_where_known():
    pl = sf.placement("cpu", MESH)
    T = 8 * 12 * 4
    p = sf.boxing.plan((8, 12), torch.float32, (pl, (sf.P, sf.P)), (pl, (sf.B, sf.B)))
    assert [(s.kind, s.dims) for s in p.steps] == [("all_reduce", (0, 1))]
    assert p.nbytes == 2 * 3 * T
    p = sf.boxing.plan((8, 12), torch.float32, (pl, (sf.S(0), sf.S(1))), (pl, (sf.S(1), sf.S(0))))
    # only the off-diagonal blocks change rank: (0,1) <-> (1,0)
    assert [s.kind for s in p.steps] == ["all_to_all"] and p.nbytes == T // 2
    # (S0, S0) -> (B, S0): each rank needs 2 quarters and holds one (or none) of them
    p = sf.boxing.plan((8, 12), torch.float32, (pl, (sf.S(0), sf.S(0))), (pl, (sf.B, sf.S(0))))
    assert p.nbytes == 6 * T // 4


CROSS = [([0, 1], [2, 3]), ([0, 1, 2, 3], MESH), ([0], [0, 1, 2, 3]), ([0, 1, 2], [1, 2, 3])]


@pytest.mark.parametrize("src,dst", CROSS)
def test_cross_placement_bytes(src, dst):
    spl, dpl = sf.placement("cpu", src), sf.placement("cpu", dst)
    _measure(spl, dpl, list(itertools.product(nd_sbps(2, spl.ndim), nd_sbps(2, dpl.ndim))), (8, 12))


def test_disjoint_costs_follow_the_table():
    a, b = sf.placement("cpu", [0, 1]), sf.placement("cpu", [2, 3])
    T = 8 * 12 * 4
    for (s, d), cost in {(sf.S(0), sf.S(0)): T, (sf.S(0), sf.B): 2 * T, (sf.B, sf.B): 2 * T,
                         (sf.P, sf.S(0)): 2 * T, (sf.P, sf.B): 3 * T}.items():
        assert sf.boxing.plan((8, 12), torch.float32, (a, s), (b, d)).nbytes == cost


def _collective_steps(pl, shape) -> list:
    """Every valid single collective step between two layouts of ``shape`` on ``pl`` (P(max)
    included), on every set of mesh dims."""
    from sbpflow.boxing.steps import classify, is_valid_move, make_step
    out = []
    dim_sets = [c for r in range(1, pl.ndim + 1) for c in itertools.combinations(range(pl.ndim), r)]
    layouts = nd_sbps(len(shape), pl.ndim, ("sum", "max"))
    for src, dst, dims in itertools.product(layouts, layouts, dim_sets):
        if any(src[e] != dst[e] for e in range(pl.ndim) if e not in dims):
            continue
        kind = classify(src, dst, dims)
        if kind is None or kind[0] == "local" or not is_valid_move(src, dst, dims):
            continue
        out.append(make_step(shape, pl, src, dst, dims, 4))
    return out


def _counted_per_rank(steps) -> list:
    """(sent, recv) this rank's Communicator counts for each step run on a zero shard."""
    from sbpflow.boxing.executor import run_step
    from sbpflow.boxing.steps import member_boxes
    comm = sf.comm.current()
    out = []
    for st in steps:
        box = member_boxes(st.shape, st.src_placement, st.src_sbp)[comm.rank]
        comm.reset_stats()
        run_step(st, torch.zeros([n for _, n in box]), comm)
        s = comm.stats()
        out.append((s.sent, s.recv))
    return out


@pytest.mark.parametrize("ranks, shape", [([0, 1, 2], (5, 7)), (MESH, (5, 7)),
                                          (MESH, (3, 1))])
def test_every_rank_counts_its_member_traffic(ranks, shape):
    """Per rank, per step (uneven shards, P(max) included): the bytes the Communicator counts
    are the kinds table's traffic rule that the planner (step.nbytes) and the cost model
    (the busiest member of a group) read."""
    from sbpflow.boxing.steps import member_traffic, placement_groups
    from sbpflow.cost.collectives import _member_bytes
    pl = sf.placement("cpu", ranks)
    steps = _collective_steps(pl, shape)
    assert {st.kind for st in steps} == {"all_gather", "reduce_scatter", "all_reduce",
                                         "all_to_all"}
    counted = sf.launch(_counted_per_rank, world_size=pl.size, args=(steps,))
    for k, st in enumerate(steps):
        want = {}
        for g in placement_groups(pl, st.dims):
            for r, t in zip(g, member_traffic(st, g)):
                want[r] = (t.sent * 4, t.recv * 4)
            assert _member_bytes(st, g) * 4 == max(max(want[r]) for r in g)
        assert [counted[r][k] for r in range(pl.size)] == [want[r] for r in range(pl.size)], \
            st.describe()
        assert sum(want[r][0] for r in want) == st.nbytes
