"""The search's layouts are `MeshLayout` s (issue 37 part 5): the pricing functions and the
`Evaluator`'s edge methods take two of them and give what the old (mesh, sbp, mesh, sbp) form
gave (which still works, with a DeprecationWarning); the backward of an edge is priced from the
gradient rule of docs/design.md; the edge tables and strategies hand out MeshLayouts."""

import itertools

import pytest

import sbpflow as sf
from sbpflow.auto import MeshLayout, model_graphs
from sbpflow.auto.evaluate import (Evaluator, redistribution, redistribution_floor,
                                   redistribution_steps)
from sbpflow.auto.search_problem import Problem
from sbpflow.auto.space import layer_space, weight_layout
from sbpflow.sbp import B, P, S

CLUSTER = sf.cost.Cluster.preset("dgx-a100", nodes=2)
MESHES = [(16,), (2, 8), (4, 4), (8, 2)]
KINDS = (S(0), S(1), B, P)


def _layouts():
    for m in MESHES:
        for nd in itertools.product(KINDS, repeat=len(m)):
            yield MeshLayout(m, nd)


def _pairs(step=7):
    lays = list(_layouts())
    return [(a, b) for k, (a, b) in enumerate(itertools.product(lays, lays)) if k % step == 0]


def _grad(lay: MeshLayout) -> MeshLayout:
    """docs/design.md's gradient layout, written out: S(a) stays, B -> P, P -> B."""
    return MeshLayout(lay.mesh, tuple(x if isinstance(x, sf.Split) else P if x == B else B
                                      for x in lay.sbp))


def test_pricing_functions_take_two_layouts_and_the_old_form_alike():
    shape, n = (64, 48), 0
    for a, b in _pairs():
        new = redistribution(shape, a, b, 4, CLUSTER, 2)
        assert redistribution(shape, tuple(a), tuple(b), itemsize=4, cluster=CLUSTER,
                              micro_batches=2) == new                 # plain pairs
        with pytest.warns(DeprecationWarning, match="pass two layouts"):
            assert redistribution(shape, *a, *b, 4, CLUSTER, 2) == new
        steps = redistribution_steps(shape, a, b)
        with pytest.warns(DeprecationWarning):
            assert redistribution_steps(shape, *a, *b) == steps
        floor = redistribution_floor(shape, a, b, 4, CLUSTER, 2)
        with pytest.warns(DeprecationWarning):
            assert redistribution_floor(shape, *a, *b, 4, CLUSTER, 2) == floor
        assert floor is None or floor <= new[0]
        n += 1
    assert n > 300
    with pytest.raises(TypeError, match="two MeshLayouts"):
        redistribution(shape, (16,), (B,), 4)


def test_evaluator_edges_take_two_layouts_and_price_the_gradient_by_the_rule():
    ev = Evaluator(model_graphs.gpt(2, 256, 8, 128, 16), CLUSTER, micro_batches=2)
    shape, moved = (64, 48), 0
    for a, b in _pairs(11):
        fwd, bwd = ev.edge_forward(shape, a, b), ev.edge_backward(shape, a, b)
        assert fwd == redistribution(shape, a, b, ev.itemsize, CLUSTER, 2)[0]
        # the gradient moves from the consumer's dual layout to the producer's
        assert bwd == redistribution(shape, _grad(b), _grad(a), ev.itemsize, CLUSTER, 2)[0]
        assert ev.edge_time(shape, a, b) == fwd + bwd
        for new, name in ((ev.edge_forward_floor(shape, a, b), "edge_forward_floor"),
                          (ev.edge_backward_floor(shape, a, b), "edge_backward_floor")):
            with pytest.warns(DeprecationWarning, match=f"Evaluator.{name}"):
                assert getattr(ev, name)(shape, *a, *b) == new
        with pytest.warns(DeprecationWarning, match="Evaluator.edge_time"):
            assert ev.edge_time(shape, *a, *b) == fwd + bwd
        moved += fwd > 0
    assert moved > 50


def test_tables_and_strategies_hand_out_mesh_layouts():
    g = model_graphs.gpt(2, 256, 8, 128, 16)
    pb = Problem(g, CLUSTER)
    for view in pb.tables.values():
        t = view.table
        assert all(type(x) is MeshLayout for x in t.rows + t.cols)
    u, v = g.edges[0]
    t = pb.tables[(u, v)]
    for k, s in enumerate(pb.cands[u]):
        assert t.table.rows[t.row_of[k]] == s.output_layout == (s.mesh, s.output)
    s = pb.cands[v][3]
    assert str(s.input_layout) == "mesh(" + ", ".join(map(str, s.mesh)) + ") " + \
        sf.sbp.format_nd_sbp(s.input)
    fc = g["h0.fc1"]
    col = next(c for c in layer_space(fc, 16) if c.label == "col:16")
    # a linear's weight (in, out) here is (out, in) in torch: S(1) is the module's S(0)
    assert weight_layout(fc, col) == MeshLayout((16,), (S(0),))
    assert type(weight_layout(fc, col)) is MeshLayout
