"""`sf.Layout`: a placement and an nd-sbp as one frozen value (issue 37, part 5): parsing, value
semantics (equal to its ``(placement, sbp)`` pair), the gradient layout ``dual()`` against
docs/design.md's rule for every sbp kind, ``str`` / ``repr``, and `sf.boxing.plan` taking
Layouts and giving the pair form's plan."""

import pickle

import pytest
import torch

import sbpflow as sf
from sbpflow.errors import PlacementError, SbpParseError
from sbpflow.layouts import Layout, as_layout

MESH = sf.placement("cpu", [[0, 1], [2, 3]])
LINE = sf.placement("cpu", [0, 1, 2, 3])


def test_parses_every_sbp_form_to_one_value():
    want = (sf.S(0), sf.B)
    forms = [want, [sf.S(0), sf.B], "S(0), B", "(S(0), B)", ("S(0)", "B")]
    lays = [sf.Layout(MESH, f) for f in forms]
    assert all(lay.sbp == want and lay.placement is MESH for lay in lays)
    assert len(set(lays)) == 1
    assert sf.Layout(LINE, sf.S(1)).sbp == (sf.S(1),)   # a single sbp on a 1-D mesh
    assert sf.Layout is Layout


def test_value_semantics():
    a, b = Layout(MESH, "S(0), B"), Layout(sf.placement("cpu", [[0, 1], [2, 3]]), "S(0), B")
    assert a == b and hash(a) == hash(b) and a is not b
    assert a != Layout(MESH, "B, S(0)") and a != Layout(MESH.reshape(4, 1), "S(0), B")
    assert a == (MESH, (sf.S(0), sf.B)) and hash(a) == hash((MESH, (sf.S(0), sf.B)))
    pl, sbp = a                                      # unpacks and indexes as the pair
    assert (pl, sbp) == (a[0], a[1]) == (a.placement, a.sbp)
    with pytest.raises(AttributeError):
        a.sbp = (sf.B, sf.B)
    assert {a: 1}[(MESH, (sf.S(0), sf.B))] == 1      # one cache entry for both forms
    assert pickle.loads(pickle.dumps(a)) == a
    assert as_layout(a) is a and as_layout((MESH, "S(0), B")) == a


def test_bad_layouts_are_refused():
    with pytest.raises(SbpParseError, match="2 dimension"):
        Layout(MESH, sf.S(0))                        # one sbp for a 2-D mesh
    with pytest.raises(SbpParseError, match="unknown sbp"):
        Layout(LINE, "Q")
    with pytest.raises(PlacementError, match="needs a Placement"):
        Layout([0, 1], sf.S(0))
    with pytest.raises(SbpParseError, match="pair"):
        as_layout(MESH)


def _rule(s):
    """docs/design.md: dual(S(a)) = S(a), dual(B) = P, dual(P) = B."""
    if isinstance(s, sf.Split):
        return sf.S(s.axis)
    return {repr(sf.B): sf.P, repr(sf.P): sf.B}[repr(s)]


@pytest.mark.parametrize("s", [sf.S(0), sf.S(1), sf.S(3), sf.B, sf.P])
def test_dual_follows_the_gradient_rule(s):
    lay = Layout(MESH, (s, sf.B))
    d = lay.dual()
    assert type(d) is Layout and d.placement is MESH
    assert d.sbp == (_rule(s), sf.P)
    assert d.dual() == lay                           # an involution
    assert d.sbp == sf.dual_nd(lay.sbp)


@pytest.mark.parametrize("op", ["max", "min"])
def test_partial_max_min_have_no_dual(op):
    with pytest.raises(SbpParseError, match="carries no gradient"):
        Layout(LINE, sf.P(op)).dual()


def test_dual_is_the_gradient_layout_of_a_tensor():
    def fn():
        x = sf.randn(4, 6, placement=MESH, sbp=(sf.S(0), sf.B), seed=0).requires_grad_()
        (x * 2).sum().backward()
        return Layout(x.grad.placement, x.grad.sbp), Layout(x.placement, x.sbp).dual()
    for grad, dual in sf.launch(fn, world_size=4):
        assert grad == dual


def test_str_and_repr():
    assert str(Layout(MESH, "S(0), B")) == "cpu[[0,1],[2,3]] (S(0), B)"
    assert str(Layout(LINE, sf.P("max"))) == "cpu[0,1,2,3] (P(max),)"
    lay = Layout(MESH, "P, S(1)")
    assert repr(lay) == "Layout(placement('cpu', ranks=[[0, 1], [2, 3]]), (P, S(1)))"
    assert eval(repr(lay), {"Layout": Layout, "placement": sf.placement, "P": sf.P,
                            "S": sf.S, "B": sf.B}) == lay


CASES = [  # (shape, src, dst): same placement, across placements, partial sources, strings
    ((8, 6), (LINE, sf.P), (LINE, sf.B)),
    ((8, 6), (MESH, (sf.S(0), sf.S(1))), (MESH, "S(1), S(0)")),
    ((8, 6), (MESH, (sf.P, sf.S(1))), (sf.placement("cpu", [4, 5]), sf.S(0))),
    ((7, 5), (LINE, "S(1)"), (MESH, (sf.B, sf.S(0)))),
]


@pytest.mark.parametrize("shape,src,dst", CASES)
def test_plan_with_layouts_equals_the_pair_form(shape, src, dst):
    sf.clear_caches()
    by_pair = sf.boxing.plan(shape, torch.float32, src=src, dst=dst)
    sf.clear_caches()
    by_layout = sf.boxing.plan(shape, torch.float32, src=Layout(*src), dst=Layout(*dst))
    mixed = sf.boxing.plan(shape, torch.float32, Layout(*src), dst)
    assert by_layout.steps == by_pair.steps == mixed.steps and by_layout.steps
    assert by_layout.nbytes == by_pair.nbytes
    assert str(by_layout) == str(by_pair)
    assert by_layout.src == Layout(*src) and by_layout.dst == Layout(*dst)
    assert type(by_pair.src) is Layout and type(by_pair.dst) is Layout
    assert str(by_pair).splitlines()[0].endswith(f"{Layout(*src)} -> {Layout(*dst)}")


def test_plan_checks_split_axes_of_a_layout():
    with pytest.raises(sf.errors.SplitAxisError, match="out of range"):
        sf.boxing.plan((4,), torch.float32, Layout(LINE, sf.S(1)), Layout(LINE, sf.B))


def test_a_global_tensor_reads_its_layout():
    """``x.global_layout``: the tensor's Layout (equal to its (placement, sbp) pair, .dual()
    its gradient's), read-only; ``x.layout`` stays torch's memory layout."""
    def run():
        x = sf.randn(4, 6, placement=MESH, sbp=(sf.S(0), sf.B), requires_grad=True)
        lay = x.global_layout
        assert type(lay) is Layout and lay == (MESH, (sf.S(0), sf.B)) == Layout(MESH, "S(0), B")
        assert str(lay) == "cpu[[0,1],[2,3]] (S(0), B)"
        (x * x).sum().backward()
        assert x.grad.global_layout == lay.dual() == (MESH, (sf.S(0), sf.P))
        with pytest.raises(AttributeError):
            x.global_layout = lay
        y = x.to_global(sbp=(sf.B, sf.S(1)))
        assert y.global_layout == Layout(MESH, "B, S(1)") and y.layout == torch.strided
        return True
    assert all(sf.launch(run, world_size=4))


def test_plan_layouts_takes_layouts_or_pairs_alike():
    sf.clear_caches()
    src, dst = Layout(MESH, "P, S(1)"), Layout(LINE, sf.S(0))
    by_layout = sf.boxing.plan_layouts((8, 6), torch.float32, src, dst)
    by_pair = sf.boxing.plan_layouts((8, 6), torch.float32, tuple(src), tuple(dst))
    assert by_pair is by_layout   # one cache entry
    assert type(by_layout.src) is Layout and by_layout.dst == dst
    sf.clear_caches()
    first = sf.boxing.plan_layouts((8, 6), torch.float32, tuple(src), tuple(dst))
    assert type(first.src) is Layout and type(first.dst) is Layout


def test_plan_layouts_old_quartet_form_warns_and_gives_the_same_plan():
    src, dst = Layout(MESH, "P, S(1)"), Layout(LINE, sf.S(0))
    new = sf.boxing.plan_layouts((8, 6), torch.float32, src, dst)
    with pytest.warns(DeprecationWarning, match="two layouts"):
        old = sf.boxing.plan_layouts((8, 6), torch.float32, *src, *dst)
    assert old is new
    with pytest.raises(TypeError):
        sf.boxing.plan_layouts((8, 6), torch.float32, *src, MESH)


# ---- MeshLayout: the strategy search's layout (a mesh shape, no ranks) -----------------------

def test_mesh_layout_is_its_pair():
    from sbpflow.layouts import MeshLayout
    a = MeshLayout((8, 4), (sf.S(0), sf.B))
    assert a == ((8, 4), (sf.S(0), sf.B)) and hash(a) == hash(((8, 4), (sf.S(0), sf.B)))
    mesh, sbp = a
    assert (mesh, sbp) == (a.mesh, a.sbp) == (a[0], a[1]) == ((8, 4), (sf.S(0), sf.B))
    assert {a: 1}[((8, 4), (sf.S(0), sf.B))] == 1    # one memo entry for both forms
    assert a != MeshLayout((4, 8), (sf.S(0), sf.B)) and a != MeshLayout((8, 4), (sf.B, sf.S(0)))
    assert a != Layout(sf.placement("cpu", list(range(32)), shape=(8, 4)), (sf.S(0), sf.B))
    assert pickle.loads(pickle.dumps(a)) == a and sf.auto.MeshLayout is MeshLayout
    with pytest.raises(AttributeError):
        a.mesh = (32,)


@pytest.mark.parametrize("s", [sf.S(0), sf.S(2), sf.B, sf.P])
def test_mesh_layout_dual_follows_the_gradient_rule(s):
    from sbpflow.layouts import MeshLayout
    a = MeshLayout((2, 3), (sf.P, s))
    d = a.dual()
    assert type(d) is MeshLayout and d.mesh == (2, 3)
    assert d.sbp == (sf.B, _rule(s)) and d.dual() == a
    # the same rule as the placed layout's
    assert d == MeshLayout.of(a.on(list(range(6))).dual())
    with pytest.raises(SbpParseError, match="carries no gradient"):
        MeshLayout((4,), (sf.P("max"),)).dual()


def test_mesh_layout_str_and_repr():
    from sbpflow.layouts import MeshLayout
    a = MeshLayout((8, 4), (sf.S(0), sf.B))
    assert str(a) == "mesh(8, 4) (S(0), B)"
    assert str(MeshLayout((16,), (sf.P,))) == "mesh(16) (P,)"
    assert repr(a) == "MeshLayout((8, 4), (S(0), B))"
    assert eval(repr(a), {"MeshLayout": MeshLayout, "S": sf.S, "B": sf.B}) == a
    assert f"{a}" == str(a) and str(a.dual()) == "mesh(8, 4) (S(0), P)"


def test_mesh_layout_from_and_to_a_layout():
    from sbpflow.layouts import MeshLayout
    lay = Layout(MESH, "S(1), P")
    m = MeshLayout.of(lay)
    assert m == ((2, 2), (sf.S(1), sf.P)) and type(m) is MeshLayout
    assert MeshLayout.of((LINE, "B")) == ((4,), (sf.B,))
    assert m.on(MESH) == lay and m.on(MESH).placement is MESH
    assert m.on([0, 1, 2, 3]) == lay                 # ranks reshaped row-major to the mesh
    back = m.on(sf.placement("cpu", [4, 5, 6, 7]))
    assert back.placement.ranks == [[4, 5], [6, 7]] and back.sbp == lay.sbp
    assert MeshLayout.of(back) == m
    with pytest.raises(PlacementError, match="needs 4 ranks, got 2"):
        m.on([0, 1])


def test_mesh_layout_parse():
    from sbpflow.layouts import MeshLayout
    assert MeshLayout.parse([8, 4], "S(0), B") == MeshLayout((8, 4), (sf.S(0), sf.B))
    assert type(MeshLayout.parse((4,), sf.B).mesh) is tuple
    with pytest.raises(SbpParseError, match="2 dimension"):
        MeshLayout.parse((8, 4), sf.S(0))
    for bad in ((), (0, 4), "84", (True, 2), None):
        with pytest.raises(PlacementError, match="shape of ints"):
            MeshLayout.parse(bad, sf.B)


def test_takes_mesh_layouts_reads_the_old_quartet_form():
    from sbpflow.layouts import MeshLayout, takes_mesh_layouts

    @takes_mesh_layouts(1)
    def f(shape, src, dst, itemsize=4):
        return src, dst, itemsize
    a, b = MeshLayout((2, 2), (sf.S(0), sf.B)), MeshLayout((4,), (sf.P,))
    assert f((8,), a, b, 2) == (a, b, 2)
    assert f((8,), tuple(a), tuple(b)) == (a, b, 4)       # pairs pass as they are
    with pytest.warns(DeprecationWarning, match="pass two layouts"):
        got = f((8,), [2, 2], [sf.S(0), sf.B], (4,), (sf.P,), itemsize=8)
    assert got == (a, b, 8) and type(got[0]) is MeshLayout and type(got[0].mesh) is tuple
    with pytest.raises(TypeError, match="two MeshLayouts"):
        f((8,), (2, 2), (sf.S(0), sf.B), 4)
