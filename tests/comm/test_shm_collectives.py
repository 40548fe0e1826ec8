"""All-gather and all-reduce through shared memory (comm/shm_collectives.py) on real gloo
processes: exact values (the threads backend's order of reduction), the path taken, the fall
back to gloo, a rank dying in the middle (nothing left in /dev/shm)."""

from __future__ import annotations

import os
import time

import pytest

from shm_collective_fns import collectives, dies_in_collective, too_big
from sbpflow.comm import launch
from sbpflow.errors import CommError


@pytest.mark.gloo
@pytest.mark.parametrize("n", [2, 3])
def test_values_are_exact_and_go_through_shared_memory(n):
    res = launch(collectives, n, backend="torch", timeout=120)
    for r, got in enumerate(res):
        assert got["mapped"], r
        want = [(0, n - 1), tuple(range(n))] if r in (0, n - 1) else [tuple(range(n))]
        assert got["groups"] == sorted(set(want)), (r, got)


@pytest.mark.gloo
def test_switched_off_and_too_big_go_through_gloo(monkeypatch):
    monkeypatch.setenv("SBPFLOW_SHM_COLLECTIVE_MB", "0")
    assert not any(o["mapped"] for o in launch(too_big, 2, backend="torch", timeout=120))
    monkeypatch.setenv("SBPFLOW_SHM_COLLECTIVE_MB", "1")
    assert all(o["mapped"] for o in launch(too_big, 2, backend="torch", timeout=120))


@pytest.mark.gloo
def test_a_rank_dying_in_the_middle_fails_the_run_and_leaves_nothing():
    before = set(os.listdir("/dev/shm"))
    with pytest.raises(CommError, match="rank 1 of 3 died with exit code 3"):
        launch(dies_in_collective, 3, backend="torch", timeout=60)
    left = set(os.listdir("/dev/shm")) - before
    if left:
        time.sleep(1.0)  # (another process's short-lived entry is gone by then)
        left &= set(os.listdir("/dev/shm"))
    assert not left, left
