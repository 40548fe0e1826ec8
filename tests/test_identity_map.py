"""utils.IdentityMap: a weak map keyed by identity (the per-parameter registries)."""

import gc

import pytest

from sbpflow.utils import IdentityMap


class Key:
    """Compares elementwise-like: ``==`` must never be called by the map."""

    def __eq__(self, other):
        raise AssertionError("the map compared keys with ==")

    __hash__ = object.__hash__


def test_lookups_go_by_identity_and_never_compare_keys():
    m, a, b = IdentityMap(), Key(), Key()
    m[a] = 1
    assert m.get(a) == 1 and a in m and m[a] == 1
    assert m.get(b) is None and b not in m and m.get(b, 7) == 7
    with pytest.raises(KeyError):
        m[b]
    m.update({b: 2})
    assert sorted(m.values()) == [1, 2] and len(m) == 2 and set(map(id, m)) == {id(a), id(b)}
    assert m.pop(a) == 1 and m.pop(a, None) is None and a not in m
    del m[b]
    assert not m


def test_an_entry_goes_with_its_key_and_a_reused_id_is_not_confused():
    m, keep = IdentityMap(), Key()
    k = Key()
    m[k], m[keep] = "old", "kept"
    del k
    gc.collect()
    assert len(m) == 1 and m.items() == [(keep, "kept")]
    # new objects (CPython may give one the dead key's id) are other keys
    news = [Key() for _ in range(100)]
    assert all(m.get(n) is None for n in news)
    m[news[0]] = "new"
    assert m.get(news[0]) == "new" and len(m) == 2
