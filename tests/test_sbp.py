"""sbp values, parsing, duals and the shard math of nd-sbps."""

import itertools

import pytest
import torch

import sbpflow as sf
from sbpflow.sbp import local_shape, part, shard_box


def test_values_and_aliases():
    assert sf.S(0) == sf.sbp.split(0) and sf.B is sf.sbp.broadcast and sf.P == sf.sbp.partial_sum
    assert sf.P("max") == sf.Partial("max") and sf.P("max") != sf.P
    assert repr(sf.S(1)) == "S(1)" and repr(sf.B) == "B" and repr(sf.P) == "P"
    assert repr(sf.P("min")) == "P(min)"
    assert len({sf.S(0), sf.S(0), sf.B, sf.P, sf.P("sum")}) == 3


@pytest.mark.parametrize("text,value", [("S(0)", sf.S(0)), (" S( 2 ) ", sf.S(2)), ("B", sf.B),
                                        ("P", sf.P), ("P(sum)", sf.P), ("P(max)", sf.P("max")),
                                        ("P(min)", sf.P("min"))])
def test_parse_one(text, value):
    assert sf.parse_sbp(text) == value


def test_parse_nd():
    assert sf.parse_nd_sbp("S(0), B") == (sf.S(0), sf.B)
    assert sf.parse_nd_sbp("(P, S(1))", 2) == (sf.P, sf.S(1))
    assert sf.parse_nd_sbp(["B", sf.S(0)], 2) == (sf.B, sf.S(0))
    assert sf.parse_nd_sbp(sf.S(0)) == (sf.S(0),)
    assert sf.parse_nd_sbp("S(0)", 1) == (sf.S(0),)


@pytest.mark.parametrize("bad", ["S", "S(-1)", "X", "P(avg)", "S(0.5)", "", 3, None])
def test_parse_errors(bad):
    with pytest.raises(sf.SbpError):
        sf.parse_nd_sbp(bad)


def test_nd_length_must_match_mesh():
    with pytest.raises(sf.errors.SbpParseError, match="2 dimension"):
        sf.parse_nd_sbp((sf.S(0),), 2)


def test_split_constructor_validates():
    with pytest.raises(sf.SbpError):
        sf.S(-1)
    with pytest.raises(sf.SbpError):
        sf.P("mean")


def test_dual():
    assert sf.dual(sf.S(1)) == sf.S(1) and sf.dual(sf.B) == sf.P and sf.dual(sf.P) == sf.B
    with pytest.raises(sf.SbpError, match="no gradient"):
        sf.dual(sf.P("max"))


def test_part_is_balanced_and_in_order():
    for n in range(0, 12):
        for m in range(1, 6):
            parts = [part(n, m, i) for i in range(m)]
            assert sum(s for _, s in parts) == n
            assert [s for _, s in parts] == [n // m + (1 if i < n % m else 0) for i in range(m)]
            assert all(parts[i][0] + parts[i][1] == parts[i + 1][0] for i in range(m - 1))


@pytest.mark.parametrize("mesh", [(4,), (2, 2), (2, 3), (2, 2, 2)])
@pytest.mark.parametrize("shape", [(7,), (5, 7), (3, 4, 5)])
def test_shards_tile_the_tensor(mesh, shape):
    """Definition check: the union of the shards of every layout without P covers each element
    once per replica; the boxes follow the nested balanced split."""
    sbps = [sf.S(a) for a in range(len(shape))] + [sf.B]
    for nd in itertools.product(sbps, repeat=len(mesh)):
        count = torch.zeros(shape, dtype=torch.int64)
        for coord in itertools.product(*(range(m) for m in mesh)):
            box = shard_box(shape, mesh, nd, coord)
            count[tuple(slice(s, s + n) for s, n in box)] += 1
            assert local_shape(shape, mesh, nd, coord) == tuple(n for _, n in box)
        replicas = 1
        for s, m in zip(nd, mesh):
            replicas *= m if s == sf.B else 1
        assert torch.all(count == replicas), nd


def test_nested_split_of_one_axis():
    # (S(0), S(0)) on 2x2 over 6 rows: [3, 3] then each [2, 1]
    boxes = [shard_box((6,), (2, 2), (sf.S(0), sf.S(0)), c) for c in [(0, 0), (0, 1), (1, 0), (1, 1)]]
    assert boxes == [((0, 2),), ((2, 1),), ((3, 2),), ((5, 1),)]
