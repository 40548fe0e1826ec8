"""The in-process backend: collectives, byte counts, failures that end runs promptly."""

import re
import threading
import time

import pytest
import torch

import sbpflow as sf
from sbpflow.comm import current

# Timing tests prove "launch does not wait for X" with a wide gap, so that a loaded 2-core CI
# machine (seconds of scheduling delay) cannot fail them: X (a stuck rank, a collective
# timeout) lasts HANG seconds, and the test asserts launch ended within PROMPT. The expected
# times are ~0-2 s (the timeout of the test, plus launch's 1 s grace after a failure).
HANG = 30.0
PROMPT = 10.0


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
        sf.launch(body, world_size=4, timeout=HANG)  # not stopped: the barrier waits HANG s
    assert time.monotonic() - t < PROMPT
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
        sf.launch(body, world_size=2, timeout=HANG)  # not stopped: backward waits HANG s
    assert time.monotonic() - t < PROMPT


class _Held:
    """A rank function's local whose lifetime the test follows (by a weak reference)."""


def test_a_failed_launch_frees_the_ranks_locals_without_the_garbage_collector():
    """No reference cycle runs through the re-raised exception: once the caller drops it, the
    locals of every rank's function (here a rank that raised and ranks aborted in a barrier)
    are freed by reference counting alone, the garbage collector off. Before, the launcher's
    frame, the ranks' frames (through the errors list) and the world (its failure) each held
    the exception its own traceback holds, and the locals lived until a gc.collect()."""
    import gc
    import weakref

    refs = []

    def body():
        held = _Held()
        refs.append(weakref.ref(held))
        if sf.rank() == 1:
            raise ValueError("boom on one")
        current().barrier()

    enabled = gc.isenabled()
    gc.disable()
    try:
        try:
            sf.launch(body, world_size=3)
        except ValueError as exc:
            assert str(exc) == "boom on one"
        alive = [r() is not None for r in refs]
    finally:
        if enabled:
            gc.enable()
    assert alive == [False] * 3


def test_exit_hooks_run_when_the_rank_function_ends():
    """`at_rank_exit`: each rank's hooks run once when its function returns or raises, before
    launch returns; a bound method is held weakly (an object gone by then is not called);
    outside a launched rank nothing is registered."""
    calls = []

    class Owner:
        def close(self):
            calls.append(("owner", sf.rank()))

    def body():
        keep = Owner()
        assert sf.comm.at_rank_exit(keep.close)
        assert sf.comm.at_rank_exit(Owner().close)  # dropped at once: never called
        assert sf.comm.at_rank_exit(lambda r=sf.rank(): calls.append(("fn", r)))
        if sf.rank() == 1:
            raise ValueError("boom")  # the traceback keeps ``keep``
        return keep  # the results keep it

    with pytest.raises(ValueError, match="boom"):
        sf.launch(body, world_size=2)
    assert sorted(calls) == [("fn", 0), ("fn", 1), ("owner", 0), ("owner", 1)]
    assert sf.comm.at_rank_exit(lambda: None) is False


def test_timeout_names_collective_and_missing_ranks():
    release = threading.Event()
    def body():
        if sf.rank() == 1:
            release.wait(10)
        current().all_reduce(torch.ones(2), (0, 1))
    try:
        with pytest.raises(sf.errors.CommTimeout, match=r"all_reduce over ranks \[0, 1\].*rank\(s\) \[1\]"
                           r".*rank 1 is not waiting for another rank \(it is at "
                           r".*test_threads.py:\d+") as info, \
                pytest.warns(RuntimeWarning, match="still running"):
            sf.launch(body, world_size=2, timeout=0.3)
    finally:
        release.set()
    assert any("rank 0 of 2" in n for n in info.value.__notes__)


def test_timeout_from_environment(monkeypatch):
    monkeypatch.setenv("SBPFLOW_TIMEOUT", "0.2")
    def body():
        if sf.rank() == 0:
            current().barrier()
        else:
            time.sleep(0.8)
            current().barrier()
    with pytest.raises(sf.errors.CommTimeout, match="barrier"):
        sf.launch(body, world_size=2)


def test_rank_that_returns_early_is_reported():
    def body():
        if sf.rank() == 0:
            current().barrier()
    t = time.monotonic()
    with pytest.raises(sf.CommError, match="already returned"):
        sf.launch(body, world_size=2, timeout=HANG)  # not noticed: a CommTimeout after HANG s
    assert time.monotonic() - t < PROMPT


def _barrier_on_rank0_else(call):
    """A rank function: rank 0 enters a barrier, every other rank ``call(communicator)``."""
    def body():
        c = current()
        if c.rank == 0:
            c.barrier()
        else:
            call(c)
    return body


def test_mismatched_collectives_are_reported():
    body = _barrier_on_rank0_else(lambda c: c.all_reduce(torch.ones(1), (0, 1)))
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


# -- a stuck rank does not hold launch (issue 12, part 4) ---------------------------------------

def test_rank_stuck_in_its_own_code_does_not_hold_launch():
    """Rank 1 never joins (stuck in its own code for HANG s): launch raises at timeout + grace
    (about 2 s), names the stuck rank and where it is, and a new launch meanwhile is
    unaffected."""
    release = threading.Event()
    def body():
        c = current()
        if c.rank == 1:
            release.wait(HANG)
            return
        c.all_reduce(torch.ones(2), (0, 1))
    t = time.monotonic()
    try:
        with pytest.raises(sf.errors.CommTimeout, match=r"rank\(s\) \[1\]") as info, \
                pytest.warns(RuntimeWarning, match=r"rank\(s\) \[1\] of 2 still running"):
            sf.launch(body, world_size=2, timeout=1.0)
        elapsed = time.monotonic() - t
        notes = "\n".join(info.value.__notes__)
        assert elapsed < PROMPT, elapsed  # waiting for the stuck rank takes HANG
        assert "rank(s) [1] of 2 still running" in notes
        assert re.search(r"rank 1 is not waiting for another rank \(it is at wait \(.*"
                         r"threading.py:\d+\) <- body \(.*test_threads.py:\d+\)\)", notes), notes
        # a later launch while the stuck thread is still there
        def later():
            return current().all_reduce(torch.full((3,), float(sf.rank() + 1)), (0, 1)).tolist()
        assert sf.launch(later, world_size=2) == [[3.0] * 3] * 2
    finally:
        release.set()


def test_rank_busy_in_python_does_not_hold_launch():
    """A rank looping in pure Python (it holds the GIL most of the time, and nothing can
    interrupt it) still lets launch raise at timeout + grace, naming the loop's line."""
    # a plain flag, not Event.is_set: the stack sample may take the loop inside a Python
    # function it calls, which would then be the innermost frame the note names
    release, give_up = [False], time.monotonic() + HANG  # bounded: no hang if broken
    def body():
        if sf.rank() == 1:
            while not release[0] and time.monotonic() < give_up:
                sum(range(1000))
        current().barrier()
    t = time.monotonic()
    try:
        with pytest.raises(sf.errors.CommTimeout) as info, pytest.warns(RuntimeWarning):
            sf.launch(body, world_size=2, timeout=0.5)
        assert time.monotonic() - t < PROMPT  # waiting for the loop takes HANG
    finally:
        release[0] = True
    notes = "\n".join(info.value.__notes__)
    assert re.search(r"rank\(s\) \[1\] of 2 still running .* rank 1 is not waiting for another "
                     r"rank \(it is at body \(.*test_threads.py:\d+\)\)", notes), notes


def test_rank_stuck_behind_a_stuck_rank_stops_and_only_the_stuck_ones_are_reported():
    """Rank 0 fails; rank 1 waits in a collective for rank 2; ranks 2 and 3 are stuck in their
    own code: rank 1 is released by the abort, ranks 2 and 3 are reported, launch raises about
    1 s after the failure. When rank 2 wakes, its collective with rank 3 (alive, so in a live
    world it would wait the HANG s timeout) raises CommAborted at once: the world is dead."""
    release, done, woke = threading.Event(), threading.Event(), []
    def body():
        r = sf.rank()
        if r == 0:
            time.sleep(0.2)
            raise ValueError("rank 0 fails")
        if r == 3:
            done.wait(HANG)  # alive until rank 2's late call is over
            return
        if r == 2:
            release.wait(HANG)
            t = time.monotonic()
            try:
                current().all_reduce(torch.ones(2), (2, 3))
            except BaseException as exc:  # noqa: BLE001
                woke.append((type(exc), time.monotonic() - t))
            finally:
                done.set()
            return
        current().all_reduce(torch.ones(2), (1, 2))
    t = time.monotonic()
    try:
        with pytest.raises(ValueError, match="rank 0 fails") as info, \
                pytest.warns(RuntimeWarning, match=r"rank\(s\) \[2, 3\] of 4"):
            sf.launch(body, world_size=4, timeout=HANG)
        assert time.monotonic() - t < PROMPT  # waiting for the stuck ranks takes HANG
    finally:
        release.set()
    notes = "\n".join(info.value.__notes__)
    assert "rank 0 of 4" in notes and "rank(s) [2, 3] of 4 still running" in notes
    assert done.wait(HANG) and woke and woke[0][0] is sf.errors.CommAborted, woke
    assert woke[0][1] < PROMPT, woke


# -- the members of a collective must agree (issue 12, part 5) ----------------------------------

def _every_rank_error(body, world_size=2, timeout=30.0):
    """Run ``body`` on every rank; return each rank's (exception type, message) or None."""
    def wrapped():
        try:
            body(current())
        except sf.CommError as exc:
            return type(exc), str(exc)
        return None
    return sf.launch(wrapped, world_size=world_size, timeout=timeout)


def _assert_all_raise(res, *needles, cls=sf.CommError):
    for r, got in enumerate(res):
        assert got is not None, f"rank {r} raised nothing"
        assert got[0] is cls, (r, got)
        for n in needles:
            assert n in got[1], (r, n, got[1])


def test_all_reduce_of_different_sizes_raises_on_every_rank():
    res = _every_rank_error(lambda c: c.all_reduce(torch.ones(1 if c.rank == 0 else 3), (0, 1)))
    _assert_all_raise(res, "all_reduce over ranks [0, 1] (call #0 on this group): the ranks "
                      "disagree", "rank 0 called all_reduce(op=sum, float32, shape (1,))",
                      "rank 1 called all_reduce(op=sum, float32, shape (3,))")
    with pytest.raises(sf.CommError, match="disagree"):  # and launch raises it
        sf.launch(lambda: current().all_reduce(torch.ones(sf.rank() + 1), (0, 1)), world_size=2)


def test_disagreeing_ranks_are_grouped():
    res = _every_rank_error(lambda c: c.all_reduce(torch.ones(2 if c.rank == 2 else 1),
                                                   (0, 1, 2, 3)), world_size=4)
    _assert_all_raise(res, "ranks [0, 1, 3] called all_reduce(op=sum, float32, shape (1,))",
                      "rank 2 called all_reduce(op=sum, float32, shape (2,))")


def test_all_reduce_dtype_and_op_must_agree():
    res = _every_rank_error(lambda c: c.all_reduce(
        torch.ones(2, dtype=torch.float64 if c.rank else torch.float32), (0, 1)))
    _assert_all_raise(res, "rank 0 called all_reduce(op=sum, float32", "rank 1 called "
                      "all_reduce(op=sum, float64")
    res = _every_rank_error(lambda c: c.all_reduce(torch.ones(2), (0, 1),
                                                   "max" if c.rank else "sum"))
    _assert_all_raise(res, "rank 0 called all_reduce(op=sum,", "rank 1 called all_reduce(op=max,")


def test_different_kinds_at_one_call_raise_on_every_rank():
    def body(c):
        if c.rank == 0:
            c.all_reduce(torch.ones(2), (0, 1))
        else:
            c.all_gather(torch.ones(2), (0, 1), [(2,), (2,)])
    _assert_all_raise(_every_rank_error(body), "collective over ranks [0, 1] (call #0",
                      "rank 0 called all_reduce(op=sum, float32, shape (2,))",
                      "rank 1 called all_gather(float32, shape (2,), expecting [(2,), (2,)])",
                      "same collectives in the same order")


@pytest.mark.parametrize("groups", [((0, 1), (1, 0)), ((0, 1, 2), (1, 2))])
def test_different_groups_are_a_deadlock_reported_at_once(groups):
    """Rank 0 (and 1 in the 3-rank case) call over groups[0], the last rank over groups[1]:
    the ranks of the cycle, and those waiting for them, raise the deadlock at once."""
    n = len(groups[0])
    def body(c):
        c.all_reduce(torch.ones(1), groups[0] if c.rank < n - 1 else groups[1])
    t = time.monotonic()
    res = _every_rank_error(body, world_size=n, timeout=HANG)
    assert time.monotonic() - t < PROMPT  # the timeout is HANG
    _assert_all_raise(res, "deadlock: rank", f"all_reduce over ranks {list(groups[0])}",
                      f"all_reduce over ranks {list(groups[1])}", "over the same groups")


def test_every_kind_checks_its_contract():
    """What each collective needs to agree: broadcast (src, shape), reduce_scatter (piece j's
    shape on every rank, the op), all_gather (declared vs passed shapes), all_to_all
    (the piece i -> j is the shape j expects from i)."""
    g = (0, 1)
    cases = [
        (lambda c: c.broadcast(torch.ones(2), c.rank, g),
         ["rank 0 called broadcast(src=0, float32, shape (2,))", "rank 1 called broadcast(src=1"]),
        (lambda c: c.broadcast(torch.ones(2 + c.rank), 0, g),
         ["rank 1 called broadcast(src=0, float32, shape (3,))"]),
        (lambda c: c.reduce_scatter([torch.ones(1), torch.ones(1 + c.rank)], g),
         ["rank 0 called reduce_scatter(op=sum, float32, piece shapes [(1,), (1,)])",
          "rank 1 called reduce_scatter(op=sum, float32, piece shapes [(1,), (2,)])"]),
        (lambda c: c.reduce_scatter([torch.ones(1)] * 2, g, "min" if c.rank else "sum"),
         ["rank 1 called reduce_scatter(op=min"]),
        (lambda c: c.reduce_scatter([torch.ones(1)] * 3, g),
         ["every rank passes 3 pieces to a group of 2"]),
        (lambda c: c.all_gather(torch.ones(2 + c.rank), g, [(2,), (2,)]),
         ["every rank expects shape (2,) from rank 1, which passes (3,)"]),
        (lambda c: c.all_gather(torch.ones(2), g, [(2,), (2 + c.rank,)]),
         ["rank 0 called all_gather(float32, shape (2,), expecting [(2,), (2,)])",
          "rank 1 called all_gather(float32, shape (2,), expecting [(2,), (3,)])"]),
        (lambda c: c.all_to_all([torch.ones(1), torch.ones(1 + c.rank)], g, [(1,), (1,)]),
         ["rank 1 expects shape (1,) from rank 1, which sends (2,)"]),
        (lambda c: c.all_to_all([torch.ones(1)] * 2, g, [(1,), (1 + c.rank,)]),
         ["rank 1 expects shape (2,) from rank 1, which sends (1,)"]),
        (lambda c: c.all_to_all([torch.ones(1, dtype=torch.float64 if c.rank else torch.float32)]
                                * 2, g, [(1,), (1,)]),
         ["rank 0 called all_to_all(float32,", "rank 1 called all_to_all(float64,"]),
    ]
    for body, needles in cases:
        _assert_all_raise(_every_rank_error(body), "the ranks disagree", *needles)


def test_recv_names_both_sides():
    def body():
        c = current()
        if c.rank == 0:
            c.send(torch.ones(2), 1)
        else:
            c.recv((3,), torch.float64, 0)
    with pytest.raises(sf.CommError, match=r"rank 1 expects a float64 tensor of shape \(3,\), "
                                           r"rank 0 sent a float32 tensor of shape \(2,\)"):
        sf.launch(body, world_size=2)


def test_recv_from_a_rank_waiting_for_me_is_a_deadlock():
    body = _barrier_on_rank0_else(lambda c: c.recv((1,), torch.float32, 0))
    t = time.monotonic()
    with pytest.raises(sf.CommError, match=r"deadlock: .*recv from rank 0"):
        sf.launch(body, world_size=2, timeout=HANG)
    assert time.monotonic() - t < PROMPT  # the timeout is HANG
