"""The in-process backend: collectives, byte counts, failures that end runs promptly."""

import time

import pytest
import torch

import sbpflow as sf
from sbpflow.comm import current


def test_collectives_values_and_counts():
    def body():
        c = current()
        r, g = c.rank, (0, 1, 2, 3)
        out = {}
        x = torch.full((r + 1, 2), float(r))
        out["ag"] = c.all_gather(x, g, [(i + 1, 2) for i in range(4)], assemble=torch.cat)
        out["ag_sub"] = c.all_gather(torch.tensor([r]), (3, 1) if r in (1, 3) else (0, 2),
                                     [(1,), (1,)], assemble=torch.cat)
        out["ar"] = c.all_reduce(torch.ones(5) * r, g)
        out["armax"] = c.all_reduce(torch.tensor([float(r)]), g, "max")
        out["rs"] = c.reduce_scatter([torch.ones(j + 1) * r for j in range(4)], g)
        out["rsmin"] = c.reduce_scatter([torch.ones(2) * (r + j) for j in range(4)], g, "min")
        out["a2a"] = c.all_to_all([torch.tensor([r * 10 + j]) for j in range(4)], g, [(1,)] * 4)
        out["bc"] = c.broadcast(torch.tensor([r * 1.0]), 2, g)
        out["p2p"] = c.exchange([((r + 1) % 4, torch.tensor([r])), ((r + 1) % 4, torch.tensor([r + 100]))],
                                [((r - 1) % 4, (1,), torch.int64), ((r - 1) % 4, (1,), torch.int64)])
        c.barrier()
        return out, c.stats()
    res = sf.launch(body, world_size=4)
    for r, (out, st) in enumerate(res):
        assert torch.equal(out["ag"], torch.cat([torch.full((i + 1, 2), float(i)) for i in range(4)]))
        assert out["ag_sub"].tolist() == ([3, 1] if r in (1, 3) else [0, 2])
        assert out["ar"].tolist() == [6.0] * 5 and out["armax"].item() == 3.0
        assert out["rs"].tolist() == [6.0] * (r + 1)
        assert out["rsmin"].tolist() == [float(r)] * 2
        assert [t.item() for t in out["a2a"]] == [j * 10 + r for j in range(4)]
        assert out["bc"].item() == 2.0
        assert [t.item() for t in out["p2p"]] == [(r - 1) % 4, (r - 1) % 4 + 100]
        # the accounting of base.py: all-gather sends (p-1) x own piece
        assert st["all_gather"].sent == 3 * (r + 1) * 2 * 4 + 8
        assert st["all_to_all"].sent == 3 * 8
        assert st["p2p"].sent == 16 and st["p2p"].recv == 16
    total = lambda kind, f: sum(getattr(s[kind], f) for _, s in res)
    for kind in ("all_gather", "all_reduce", "reduce_scatter", "all_to_all", "broadcast", "p2p"):
        assert total(kind, "sent") == total(kind, "recv"), kind
    assert total("all_reduce", "sent") == 2 * 3 * 5 * 4 + 2 * 3 * 4  # 2(p-1)|T|, two calls


def test_results_do_not_alias_other_ranks():
    def body():
        c = current()
        x = torch.full((3,), float(c.rank))
        got = c.all_gather(x, (0, 1))
        x.add_(100)  # changing my input afterwards must not change what others received
        c.barrier()
        return [t.tolist() for t in got]
    assert sf.launch(body, world_size=2) == [[[0.0] * 3, [1.0] * 3]] * 2


def test_failing_rank_stops_the_others_promptly():
    def body():
        if sf.rank() == 2:
            raise ValueError("boom on two")
        current().barrier()
    t = time.monotonic()
    with pytest.raises(ValueError, match="boom on two") as info:
        sf.launch(body, world_size=4)
    assert time.monotonic() - t < 2.0
    assert any("rank 2" in n for n in getattr(info.value, "__notes__", []))


def test_failure_inside_backward_stops_the_run():
    def body():
        pl = sf.placement("cpu", [0, 1])
        x = sf.randn(4, 4, placement=pl, sbp=sf.S(0), seed=0, requires_grad=True)
        y = x.to_global(sbp=sf.B)
        if sf.rank() == 1:
            raise RuntimeError("rank 1 dies before backward")
        y.backward(sf.ones(4, 4, placement=pl, sbp=sf.P))
    t = time.monotonic()
    with pytest.raises(RuntimeError, match="dies before backward"):
        sf.launch(body, world_size=2)
    assert time.monotonic() - t < 2.0


def test_timeout_names_collective_and_missing_ranks():
    def body():
        if sf.rank() == 1:
            time.sleep(1.5)
        current().all_reduce(torch.ones(2), (0, 1))
    with pytest.raises(sf.CommTimeout, match=r"all_reduce over ranks \[0, 1\].*rank\(s\) \[1\]"):
        sf.launch(body, world_size=2, timeout=0.3)


def test_timeout_from_environment(monkeypatch):
    monkeypatch.setenv("SBPFLOW_TIMEOUT", "0.2")
    def body():
        if sf.rank() == 0:
            current().barrier()
        else:
            time.sleep(0.8)
            current().barrier()
    with pytest.raises(sf.CommTimeout, match="barrier"):
        sf.launch(body, world_size=2)


def test_rank_that_returns_early_is_reported():
    def body():
        if sf.rank() == 0:
            current().barrier()
    t = time.monotonic()
    with pytest.raises(sf.CommError, match="already returned"):
        sf.launch(body, world_size=2)
    assert time.monotonic() - t < 2.0


def test_mismatched_collectives_are_reported():
    def body():
        c = current()
        if c.rank == 0:
            c.barrier()
        else:
            c.all_reduce(torch.ones(1), (0, 1))
    with pytest.raises(sf.CommError, match="same collectives in the same order"):
        sf.launch(body, world_size=2)


def test_rank_and_world_size_and_default_world():
    assert sf.launch(lambda: (sf.rank(), sf.world_size()), world_size=3) == [(0, 3), (1, 3), (2, 3)]
    assert sf.rank() == 0 and sf.world_size() == 1  # outside launch: a single-rank world


def test_bad_launch_arguments():
    with pytest.raises(sf.SbpError, match="world_size"):
        sf.launch(lambda: None, world_size=0)
    with pytest.raises(sf.SbpError, match="backend"):
        sf.launch(lambda: None, world_size=1, backend="mpi")


def test_per_rank_rng_is_not_shared():
    def body():
        sf.manual_seed(sf.rank())
        return sf.randn(3, placement=sf.placement("cpu", [sf.rank()]), sbp=sf.B).local.tolist()
    a, b = sf.launch(body, world_size=2)
    a2, b2 = sf.launch(body, world_size=2)
    assert a == a2 and b == b2 and a != b
