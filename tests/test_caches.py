"""sbpflow.caches: every memo table is registered with a bound; sf.clear_caches() empties them
all at any time between ops without changing results."""

import pytest
import torch

import sbpflow as sf
from sbpflow.caches import BoundedDict, memoize


def test_every_cache_is_registered_and_bounded():
    info = sf.cache_info()
    for name in ("tensor.dispatch_choices", "tensor.layout_keys", "boxing.transfer_routes",
                 "sbpflow.ops.registry.out_metas"):
        assert name in info
    assert all(i.maxsize > 0 for i in info.values())


def test_bounded_dict_empties_itself_when_full():
    d = BoundedDict("tests.bounded_dict_demo", maxsize=3)
    for k in range(3):
        d.put(k, k * k)
    assert len(d) == 3 and sf.cache_info()["tests.bounded_dict_demo"].size == 3
    assert d.put(3, 9) == 9
    assert dict(d) == {3: 9}


def test_memoize_registers_and_clears():
    calls = []

    @memoize(4, name="tests.memoize_demo")
    def square(x):
        calls.append(x)
        return x * x

    assert square(3) == 9 and square(3) == 9 and calls == [3]
    sf.clear_caches()
    assert sf.cache_info()["tests.memoize_demo"].size == 0
    assert square(3) == 9 and calls == [3, 3]
    again = memoize(4, name="tests.memoize_demo")(lambda x: -x)   # a reloaded module: replaces
    again(2)
    assert sf.cache_info()["tests.memoize_demo"].size == 1


def test_bounded_dict_setdefault_keeps_the_first_value_within_the_bound():
    d = BoundedDict("tests.setdefault_demo", maxsize=2)
    assert d.setdefault("a", 1) == 1 and d.setdefault("a", 2) == 1
    d.setdefault("b", 3)
    assert d.setdefault("c", 4) == 4 and dict(d) == {"c": 4}


def test_clearing_caches_between_ops_keeps_results():
    a = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    w = torch.randn(4, 5, generator=torch.Generator().manual_seed(1))

    def body():
        mesh = sf.placement("cpu", ranks=[[0, 1], [2, 3]])
        x = sf.tensor(a, mesh, (sf.S(0), sf.B))
        y = sf.tensor(w, mesh, (sf.B, sf.S(1)))
        first = (x @ y).relu().sum(dim=0).full_tensor()
        sf.clear_caches()      # every rank clears its process's caches: harmless, results equal
        second = (x @ y).relu().sum(dim=0).full_tensor()
        return first, second

    for first, second in sf.launch(body, world_size=4):
        torch.testing.assert_close(first, (a @ w).relu().sum(dim=0))
        assert torch.equal(first, second)


def test_collector_paused_nests_and_restores_the_collectors_state():
    import gc
    from sbpflow.caches import collector_paused
    was = gc.isenabled()
    try:
        for start in (True, False):
            (gc.enable if start else gc.disable)()
            with collector_paused():
                assert not gc.isenabled()
                with collector_paused():
                    assert not gc.isenabled()
                assert not gc.isenabled()   # the outer block still holds the pause
            assert gc.isenabled() == start
            with pytest.raises(RuntimeError):
                with collector_paused():
                    raise RuntimeError("the state is restored on errors too")
            assert gc.isenabled() == start
    finally:
        (gc.enable if was else gc.disable)()


def test_a_search_runs_with_the_collector_paused(monkeypatch):
    """`sf.auto.search` pauses the cyclic collector while its memos fill (docs/auto.md) and
    gives it back as it found it."""
    import gc
    import importlib
    S = importlib.import_module("sbpflow.auto.strategy_search")
    seen = []
    cost = S.Problem.cost

    def spy(self, state):
        seen.append(gc.isenabled())
        return cost(self, state)
    monkeypatch.setattr(S.Problem, "cost", spy)
    from sbpflow.auto import model_graphs
    assert gc.isenabled()
    sf.auto.search(model_graphs.mlp(), sf.cost.Cluster.preset("dgx-a100", nodes=1), "cd")
    assert seen and not any(seen)
    assert gc.isenabled()
