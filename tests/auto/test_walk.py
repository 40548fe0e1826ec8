"""The analytic walk runs on integer-coded layouts (`sbpflow.auto.walk`); its rules must be the
boxing planner's on sbps, and its records the sbp values the planner reads."""

import importlib
import itertools

from sbpflow.boxing.steps import is_local_change, is_valid_move
from sbpflow.sbp import B, P, Partial, S

W = importlib.import_module("sbpflow.auto.walk")
E = importlib.import_module("sbpflow.auto.evaluate")
RP = importlib.import_module("sbpflow.auto.redistribution_price")

SBPS = (S(0), S(1), S(2), B, P, Partial("max"), Partial("min"))


def test_layout_codes_round_trip_and_tell_kinds_apart():
    for nd in itertools.product(SBPS, repeat=2):
        codes = W.layout_code(nd)
        assert W._layout(codes) == nd
        for x, c in zip(nd, codes):
            assert (c >= 0) == x.is_split and (c == -1) == x.is_broadcast
            assert (c <= -2) == x.is_partial
    assert W._layout([40]) == (S(40),)


def test_valid_on_codes_is_the_boxing_planners_rule_for_every_move_of_three_dims():
    kinds = (S(0), S(1), B, P)
    dims_sets = [d for r in (1, 2, 3) for d in itertools.combinations(range(3), r)]
    checked = 0
    for src in itertools.product(kinds, repeat=3):
        for dst in itertools.product(kinds, repeat=3):
            sc, dc = W.layout_code(src), W.layout_code(dst)
            for dims in dims_sets:
                assert W._valid(sc, dc, dims) == is_valid_move(src, dst, dims), (src, dst, dims)
                checked += 1
    assert checked == 64 * 64 * 7


def test_two_partials_are_reduced_first_exactly_when_no_local_step_joins_them():
    partials = (P, Partial("max"), Partial("min"))
    for a, b in itertools.product(partials, repeat=2):
        out = W._reduced_first(W.layout_code((a,)), W.layout_code((b,)), 2)
        assert (out[0] >= 0) == (not is_local_change(a, b)), (a, b)


def test_transfer_least_loads_are_the_least_of_each_reductions_options():
    # axis 0 split twice in the source: a transfer; of the reduce-scatters, the one along
    # axis 1 (not the first) lacks least
    fine, s, d = (2, 2, 4), (S(0), S(0), P), (S(0), S(1), S(1))
    how, t = RP.find_walk(3, fine, s, fine, d)
    assert how == "transfer"
    by_kind: dict = {}
    for o in t.options:
        kind = None if o.pre is None else o.pre[0]
        by_kind[kind] = min(by_kind.get(kind, float("inf")), o.lack)
    assert {k: lack for k, *_, lack in t.least} == by_kind
    assert {k for k, *_ in t.least} == {"all_reduce", "reduce_scatter"}
    lacks = [o.lack for o in t.options if o.pre is not None and o.pre[0] == "reduce_scatter"]
    assert lacks.index(min(lacks)) == 1 and len(set(lacks)) == 2
    for kind, pdims, div, g, _ in t.least:
        assert pdims == (2,) and g == 4 and div == 4


def test_prices_and_floors_kept_by_walk_are_each_layout_pairs_own():
    """The evaluator keeps prices by (walk, shape): pairs of meshes that refine to one walk
    share a price. Each must still be what `redistribution` gives that pair (a key missing
    the shape, or a walk shared by pairs that differ, fails here)."""
    import sbpflow as sf
    from sbpflow.auto import model_graphs
    cluster = sf.cost.Cluster.preset("dgx-a100", nodes=2)
    ev = E.Evaluator(model_graphs.gpt(2, 256, 8, 128, 16), cluster, micro_batches=2)
    meshes = [(16,), (2, 8), (4, 4), (2, 2, 4)]
    kinds = (S(0), S(1), B, P)
    checked = 0
    for shape in ((64, 48), (64, 40)):
        for am, bm in itertools.product(meshes, repeat=2):
            for a in itertools.product(kinds, repeat=len(am)):
                for b in itertools.product(kinds[:3], repeat=len(bm)):
                    want = E.redistribution(shape, am, a, bm, b, ev.itemsize, cluster, 2)
                    assert ev._redist(shape, am, a, bm, b, 2) == want, (shape, am, a, bm, b)
                    floor, exact = ev._floor(shape, am, a, bm, b)
                    direct = E.redistribution_floor(shape, am, a, bm, b, ev.itemsize, cluster,
                                                    2)
                    assert floor == (want[0] if exact else direct) and exact == (direct is None)
                    checked += 1
    assert checked > 5000
    assert len(ev._walk_prices) < len(ev._prices) / 2   # walks are shared, and often
