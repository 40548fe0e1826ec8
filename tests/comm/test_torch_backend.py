"""The torch.distributed backend on 4 real gloo processes, against values computed in plain torch.

The launched functions are in `gloo_fns` (each rank imports their module by name).
"""

from __future__ import annotations

import re
import time

import pytest
import torch

from gloo_fns import (P, async_progress_fn, collectives_fn, crash_fn, fail_fn, mismatch_fn,
                      p2p_timeout_fn, skip_collective_fn, sleep_fn, timeout_fn,
                      unpicklable_exc_fn)
from sbpflow.comm import launch
from sbpflow.errors import CommError, CommTimeout, SbpError
from stuck_fns import NAP_OP, stuck_step


@pytest.mark.gloo
def test_collectives_values_and_bytes():
    res = launch(collectives_fn, P, backend="torch")
    assert len(res) == P
    # all ranks hold bit-identical all-reduce results
    for key in [k for k in res[0] if k.startswith("all_reduce_sum")]:
        holders = [o[key] for o in res if key in o]
        assert all(torch.equal(h, holders[0]) for h in holders), key
    # subgroups were created for the non-world groups only
    assert res[1]["subgroups"] == [(1, 3)]
    assert res[0]["subgroups"] == [(0, 2, 3)]
    assert res[3]["subgroups"] == [(0, 2, 3), (1, 3)]
    # Σ sent == Σ received over the world
    assert sum(o["sent"] for o in res) == sum(o["recv"] for o in res)


@pytest.mark.gloo
def test_rank_exception_is_reraised_promptly():
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="boom on rank 2") as info:
        launch(fail_fn, P, backend="torch", timeout=120)
    assert time.monotonic() - t0 < 30
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "raised on rank 2 of 4 (sbpflow torch backend)" in notes
    assert "fail_fn" in notes  # the child's traceback


@pytest.mark.gloo
def test_dead_rank_and_unpicklable_exception_give_comm_errors():
    t0 = time.monotonic()
    with pytest.raises(CommError, match=r"rank 1 of 4 died with exit code 7"):
        launch(crash_fn, P, backend="torch", timeout=120)
    with pytest.raises(CommError, match="_Unpicklable") as info:
        launch(unpicklable_exc_fn, P, backend="torch", timeout=120)
    assert "unpicklable_exc_fn" in "\n".join(getattr(info.value, "__notes__", []))
    assert time.monotonic() - t0 < 60


@pytest.mark.gloo
def test_overall_bound(monkeypatch):
    monkeypatch.setenv("SBPFLOW_LAUNCH_TIMEOUT", "3")
    t0 = time.monotonic()
    with pytest.raises(CommError, match="SBPFLOW_LAUNCH_TIMEOUT"):
        launch(sleep_fn, P, backend="torch")
    assert time.monotonic() - t0 < 30


@pytest.mark.gloo
def test_unpicklable_function_is_refused():
    with pytest.raises(SbpError, match="module-level"):
        launch(lambda: 1, P, backend="torch")


@pytest.mark.gloo
def test_init_from_env_needs_torchrun_env(monkeypatch):
    from sbpflow.comm.torch_backend import init_from_env
    import torch.distributed as dist
    if dist.is_initialized():
        pytest.skip("torch.distributed already initialized in this process")
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(CommError, match="torchrun"):
        init_from_env(None)


@pytest.mark.gloo
def test_collective_timeout_is_a_comm_timeout():
    t0 = time.monotonic()
    with pytest.raises(CommTimeout, match="SBPFLOW_TIMEOUT"):
        launch(timeout_fn, 3, backend="torch", timeout=2)
    assert time.monotonic() - t0 < 30


@pytest.mark.gloo
def test_timeout_names_the_rank_that_did_not_arrive():
    """Ranks 0 and 1 wait in all_reduce #2 of the world; rank 2 sleeps after #1. Whichever of
    0 and 1 reports first, launch re-raises its CommTimeout, naming rank 2 and where it is."""
    t0 = time.monotonic()
    with pytest.raises(CommTimeout) as info:
        launch(skip_collective_fn, 3, backend="torch", timeout=2)
    assert time.monotonic() - t0 < 20
    msg = str(info.value)
    assert re.search(r"all_reduce\(sum\) over ranks \[2, 0, 1\] \(collective #2 of that group\) "
                     r"timed out on rank [01] after 2 s: rank\(s\) \[2\] did not arrive \(rank 2:"
                     r" entered #1 of that group last, in no collective for [\d.]+ s \(its last: "
                     r"all_reduce\(sum\) over ranks \[0, 1, 2\] #1\)", msg), msg
    assert "arrived: [0, 1]" in msg and "SBPFLOW_TIMEOUT=<seconds>" in msg
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert re.search(r"raised on rank [01] of 3", notes), notes


@pytest.mark.gloo
def test_a_rank_stuck_in_an_eager_step_is_named_with_its_last_op():
    """Eager data parallelism on 2 ranks: rank 1 sleeps inside an op of its second forward;
    rank 0's gradient all-reduce times out. The error names rank 1 as its culprit and the
    last sbpflow op it started (before: only its last collective)."""
    with pytest.raises(CommTimeout) as info:
        # (the nap lasts until the run is stopped: 5 s keeps the first step's collectives clear
        # of process start-up on a loaded machine)
        launch(stuck_step, 2, backend="torch", args=("eager", 1), timeout=5)
    msg = str(info.value)
    assert info.value.culprits == (1,), msg
    assert re.search(r"timed out on rank 0 after 5 s: rank\(s\) \[1\] did not arrive \(rank 1: "
                     r"entered #\d+ of that group last, in no collective for [\d.]+ s .*; the "
                     rf"last sbpflow op it started: '{NAP_OP}'\); arrived: \[0\]", msg), msg


@pytest.mark.gloo
def test_timeout_says_what_the_missing_rank_waits_in():
    """Mismatched calls: ranks 0 and 1 wait in the world barrier, rank 2 in the rendezvous of
    subgroup (1, 2). Each side's error says the other side is inside the other collective
    (ranks 0 / 1 time out first, as rank 2 starts later; either report is checked)."""
    with pytest.raises(CommTimeout) as info:
        launch(mismatch_fn, 3, backend="torch", timeout=2)
    msg = str(info.value)
    world = (r"barrier over ranks \[0, 1, 2\] \(collective #1 of that group\) timed out on rank "
             r"[01] after 2 s: rank\(s\) \[2\] did not arrive \(rank 2: entered none of that "
             r"group's collectives, inside creating the process group over ranks \[1, 2\] \(#1\)"
             r" for [\d.]+ s\); arrived: \[0, 1\]")
    sub = (r"creating the process group over ranks \[2, 1\] \(collective #1 of that group\) "
           r"timed out on rank 2 after 2 s: rank\(s\) \[1\] did not arrive \(rank 1: entered "
           r"none of that group's collectives, inside barrier over ranks \[0, 1, 2\] \(#1\) for "
           r"[\d.]+ s\); arrived: \[2\]")
    assert re.search(world, msg) or re.search(sub, msg), msg


@pytest.mark.gloo
def test_p2p_timeout_says_what_the_peer_is_doing():
    with pytest.raises(CommTimeout) as info:
        launch(p2p_timeout_fn, 2, backend="torch", timeout=2)
    msg = str(info.value)
    assert re.search(r"^exchange with ranks \[1\] timed out on rank 0 after 2 s: rank 1: in no "
                     r"collective for [\d.]+ s \(its last: barrier over ranks \[0, 1\] #1\)",
                     msg), msg


@pytest.mark.gloo
def test_progress_records_of_asynchronous_all_reduces():
    """An all-reduce started and not waited for is open (not waited in) until ``wait()``,
    whatever finishes meanwhile; one dropped unwaited is closed (the rank will never wait in
    it). Numbers count from the first all-reduce of `async_progress_fn`."""
    for r, out in enumerate(launch(async_progress_fn, 2, backend="torch", timeout=60)):
        assert out["started"] == (1, {1: False}), (r, out)
        assert out["after_sync"] == (2, {1: False}), (r, out)  # #2 ended: #1 is still open
        assert out["waited"] == (2, {}), (r, out)
        assert out["dropped"] == (3, {}), (r, out)
        assert (out["sync"], out["async"], out["next"]) == (30.0, 3.0, 3000.0), (r, out)
