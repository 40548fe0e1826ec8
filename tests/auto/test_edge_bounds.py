"""The edge tables' lower bounds (`sbpflow.auto.edge_bounds.edge_lower_bounds`) never exceed
the price, nor the backward-only bounds the backward part: every entry of every distinct
table filled and compared (the backward part on a sample). The dynamic programme
and the pruned min-plus skip entries by these bounds, so a bound above its price could
change a search's answer."""

import dataclasses

import numpy as np
import pytest

import sbpflow as sf
from sbpflow.auto import model_graphs
from sbpflow.auto.edge_bounds import edge_lower_bounds
from sbpflow.auto.evaluate import Evaluator
from sbpflow.auto.strategy_search import Problem


def _check_tables(pb, seen: set) -> int:
    """Fill each table of ``pb`` not in ``seen`` (by content) and assert lower <= price;
    the number of entries checked."""
    n = 0
    for t in {id(v.table): v.table for v in pb.tables.values()}.values():
        key = (t.shape, tuple(t.rows), tuple(t.cols), pb.ev.micro)
        if key in seen:
            continue
        seen.add(key)
        t.fill_all()
        bad = np.argwhere(t.lower > t.M)
        assert not len(bad), (t.shape, t.rows[bad[0][0]], t.cols[bad[0][1]],
                              t.lower[tuple(bad[0])], t.M[tuple(bad[0])])
        # the backward direction's own bound, which prunes before the backward is priced
        # (on 1,500 entries a table: pricing each direction again is slow)
        rng = np.random.default_rng(len(seen))
        for i, j in zip(rng.integers(0, t.M.shape[0], 1500), rng.integers(0, t.M.shape[1], 1500)):
            bwd = pb.ev.edge_backward(t.shape, *t.rows[i], *t.cols[j])
            assert t.lower_bwd[i, j] <= bwd, (t.shape, t.rows[i], t.cols[j])
        assert (t.lower_bwd <= t.lower).all() and (t.lower_bwd > 0).any()
        n += t.M.size
    return n


# (model and cluster, the (ZeRO, micro-batches) problems checked): ZeRO and micro-batches
# each change the prices on their own; VGG-13's tables are the most (its check the longest
# test of the suite), so it checks the plain problem and the GPTs the other
CASES = {"vgg13-supercomputer-16": ((False, 1),), "gpt-dgx-2": ((True, 4),),
         "gpt-4x4": ((False, 1), (True, 4))}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_edge_lower_bounds_below_every_price(name):
    g, c = {
        "vgg13-supercomputer-16": (model_graphs.vgg13(16), sf.cost.Cluster.preset(
            "supercomputer", nodes=16, flops_per_device=None)),
        "gpt-dgx-2": (model_graphs.gpt(2, 256, 8, 128, 16),
                      sf.cost.Cluster.preset("dgx-a100", nodes=2)),
        # 4 devices a node: meshes of 16 whose dims cross the node boundary part way
        "gpt-4x4": (model_graphs.gpt(2, 256, 8, 128, 16),
                    sf.cost.Cluster.preset("dgx-a100", nodes=4, devices_per_node=4)),
    }[name]
    seen: set = set()
    # with micro-batches every move's latency counts once a micro-batch (the bound's too)
    n = sum(_check_tables(Problem(g, c, zero=zero, micro_batches=m), seen)
            for zero, m in CASES[name])
    assert n > 10_000


def test_node_bound_binds_across_nodes():
    """On two 8-GPU nodes, gathering a tensor split over all 16 ranks (and, backward,
    reduce-scattering its gradient): node 0 lacks half of the tensor each way, which crosses
    the nodes at the inter-node beta shared by 8 devices; that is above rank 0's 15/16 at
    NVLink's beta, and below the price. Each direction also pays at least one message at
    the least alpha (NVLink's)."""
    c = sf.cost.Cluster.preset("dgx-a100", nodes=2)
    shape = (1024, 1024)
    split, full = ((16,), (sf.S(0),)), ((16,), (sf.B,))
    lo = edge_lower_bounds(shape, 4, c, [split], [full])[0, 0]
    price = Evaluator(model_graphs.mlp((8, 8), batch=8), c, 1).edge_time(
        shape, *split, *full)
    nbytes = 1024 * 1024 * 4
    assert lo == pytest.approx((2 * 0.5 * nbytes * c.inter.beta / 8 + 2 * c.intra.alpha) *
                               (1 - 1e-9))
    assert 2 * 15 / 16 * nbytes * c.intra.beta < lo <= price


def test_table_bound_is_each_pair_bound():
    """The dense bound of a table (found on distinct layout features and gathered) equals
    the bound of each (row, column) pair on its own, bit for bit; between meshes with no
    common refinement ((4, 6) and (6, 4)) it is the rank bound alone (the node bound needs
    real moves), elsewhere at least that and sometimes more."""
    c = sf.cost.Cluster.preset("dgx-a100", nodes=12, devices_per_node=2)   # 24 devices
    sbps = [sf.S(0), sf.S(1), sf.B, sf.P]
    meshes = [(24,), (4, 6), (6, 4), (2, 12), (3, 8)]
    layouts = [(m, nd) for m in meshes for nd in
               ([(x,) for x in sbps] if len(m) == 1 else [(x, y) for x in sbps for y in sbps])]
    shape = (48, 96)
    table = edge_lower_bounds(shape, 4, c, layouts, layouts, 3)
    # above TRANSFER_MAX_RANKS devices there is no node bound: the rank bound alone
    rank = edge_lower_bounds(shape, 4, dataclasses.replace(c, nodes=200), layouts, layouts, 3)
    assert table.shape == (len(layouts), len(layouts)) and (table > 0).any()
    for i, j in np.random.default_rng(0).integers(0, len(layouts), size=(300, 2)):
        one = edge_lower_bounds(shape, 4, c, [layouts[i]], [layouts[j]], 3)[0, 0]
        assert one == table[i, j], (layouts[i], layouts[j])
    apart = np.array([[{a[0], b[0]} == {(4, 6), (6, 4)} for b in layouts] for a in layouts])
    assert np.array_equal(table[apart], rank[apart])
    assert (table[~apart] >= rank[~apart]).all() and (table[~apart] > rank[~apart]).any()


@pytest.mark.parametrize("micro", [1, 4])
def test_walk_floors_below_each_direction_and_above_the_dense_bound(micro):
    """`Evaluator.edge_forward_floor` / `edge_backward_floor` (the search raises an entry's
    bound to them before pricing it) are each direction's price when they say so (the fixed
    order's moves) and below it otherwise, on a sample of every table of a GPT on two 8-GPU
    nodes; and on transfers across nodes they are far above the dense bound, which must
    assume NVLink's beta."""
    g = model_graphs.gpt(2, 256, 8, 128, 16)
    pb = Problem(g, sf.cost.Cluster.preset("dgx-a100", nodes=2), micro_batches=micro)
    ev, rng, n, above, bounds = pb.ev, np.random.default_rng(micro), 0, 0, 0
    for t in {id(v.table): v.table for v in pb.tables.values()}.values():
        for i, j in zip(rng.integers(0, t.M.shape[0], 400), rng.integers(0, t.M.shape[1], 400)):
            pair = (t.shape, *t.rows[i], *t.cols[j])
            for price, (floor, exact) in ((ev.edge_forward(*pair), ev.edge_forward_floor(*pair)),
                                          (ev.edge_backward(*pair),
                                           ev.edge_backward_floor(*pair))):
                # (strictly below, by the bounds' 1e-9, unless nothing moves at all)
                assert floor == price if exact else 0 <= floor < price or floor == price == 0, \
                    (pair, floor, price)
                if not exact:
                    bounds += 1
                    above += floor > 4 * t.lower[i, j]
            n += 1
    assert n >= 2000 and bounds > n // 10 and above > bounds // 4, (n, bounds, above)


def test_a_layout_list_changed_in_place_gets_its_own_bounds():
    """The bound sides are kept by the layout list (a table asks three times); a list whose
    items change in place between calls gets the bounds of its new items, not the old."""
    c = sf.cost.Cluster.preset("dgx-a100", nodes=2)
    shape = (64, 32)
    rows = [((16,), (sf.S(0),)), ((4, 4), (sf.S(0), sf.S(1)))]
    cols = [((16,), (sf.B,)), ((16,), (sf.S(1),))]
    before = edge_lower_bounds(shape, 4, c, rows, cols)
    again = edge_lower_bounds(shape, 4, c, rows, cols)
    assert np.array_equal(before, again)
    rows[0] = ((16,), (sf.P,))
    cols[1] = ((2, 8), (sf.S(1), sf.S(0)))
    changed = edge_lower_bounds(shape, 4, c, rows, cols)
    fresh = edge_lower_bounds(shape, 4, c, list(rows), list(cols))
    assert np.array_equal(changed, fresh) and not np.array_equal(changed, before)
