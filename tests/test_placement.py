"""Placements: meshes of ranks, coordinates, groups, sub-meshes, errors."""

import pytest

import sbpflow as sf


def test_metadata():
    mesh = sf.placement("cpu", ranks=[[0, 1], [2, 3]])
    assert mesh.shape == (2, 2) and mesh.ndim == 2 and mesh.size == 4
    assert mesh.ranks == [[0, 1], [2, 3]] and mesh.device_type == "cpu"
    assert mesh.coord_of(2) == (1, 0) and mesh.rank_at((0, 1)) == 1
    assert 3 in mesh and 4 not in mesh
    line = sf.placement("cuda", ranks=[0, 1, 2])
    assert line.shape == (3,) and line.device_type == "cuda"


def test_groups_along_dims():
    mesh = sf.placement("cpu", [[0, 1, 2], [3, 4, 5]])
    assert mesh.group((1,), (1, 0)) == (3, 4, 5)
    assert mesh.group((0,), (0, 2)) == (2, 5)
    assert mesh.group((0, 1), (0, 0)) == (0, 1, 2, 3, 4, 5)


def test_equality_and_hash():
    a = sf.placement("cpu", [[0, 1], [2, 3]])
    assert a == sf.placement("cpu", [[0, 1], [2, 3]]) and hash(a) == hash(sf.placement("cpu", [[0, 1], [2, 3]]))
    assert a != sf.placement("cpu", [0, 1, 2, 3]) and a != sf.placement("cuda", [[0, 1], [2, 3]])
    assert a != sf.placement("cpu", [[0, 2], [1, 3]])
    assert a.flatten() == sf.placement("cpu", [0, 1, 2, 3])
    assert sf.placement("cpu", [0, 1, 2, 3]).reshape(2, 2) == a


def test_sub_meshes():
    mesh = sf.placement("cpu", [[0, 1], [2, 3]])
    assert mesh[1] == sf.placement("cpu", [2, 3])
    assert mesh.sub(1, 0) == sf.placement("cpu", [0, 2])
    cube = sf.placement("cpu", [[[0, 1], [2, 3]], [[4, 5], [6, 7]]])
    assert cube[1] == sf.placement("cpu", [[4, 5], [6, 7]])


@pytest.mark.parametrize("ranks,match", [([0, 0, 1], "duplicate"), ([[0, 1], [2]], "ragged"),
                                         ([], "non-empty"), ([-1, 0], "non-negative"),
                                         (3, "list"), ([[0, 1], 2], "mix")])
def test_bad_ranks(ranks, match):
    with pytest.raises(sf.PlacementError, match=match):
        sf.placement("cpu", ranks)


def test_bad_device_and_world():
    with pytest.raises(sf.PlacementError, match="device type"):
        sf.placement("tpu", [0])
    with pytest.raises(sf.PlacementError, match="only 2 rank"):
        sf.placement("cpu", [0, 1, 2]).check_world(2)
