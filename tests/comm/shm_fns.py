"""Rank functions of tests/comm/test_shm_cleanup.py: a large message through the shared-memory
ring of two rank processes, then an end of the run (`ring_then`), or a wait to be killed."""

import os
import signal
import time

import torch

import sbpflow as sf

BIG = 1 << 18  # float32 elements of the message: 1 MiB, well above shm_ring.RING_MIN


def _maps_ring() -> bool:
    with open("/proc/self/maps") as f:
        return "sbpflow-ring" in f.read()


def _hand_over() -> bool:
    """Rank 0 posts a tensor to rank 1, which checks it; both say whether they map a ring."""
    comm = sf.comm.current()
    x = torch.arange(BIG, dtype=torch.float32)
    if comm.rank == 0:
        comm.post(1, "c", ("big", x))
    else:
        got = []
        while not got:
            got = comm.inbox("c", 1.0)
        assert torch.equal(got[0][1][1], x)
    return _maps_ring()


def ring_then(how: str) -> bool:
    """After the hand-over, rank 1 ends the run ``how``: "ok" (both return), "raise",
    "kill" (SIGKILL to itself), "timeout" (a barrier rank 0, asleep, never joins)."""
    mapped = _hand_over()
    rank = sf.comm.current().rank
    if how == "ok" or rank == 0:
        if how != "ok":
            time.sleep(60)  # the launcher stops it
        return mapped
    if not mapped:
        raise AssertionError("rank 1 maps no ring: the shared-memory path was not taken")
    if how == "raise":
        raise ValueError("rank 1 fails on purpose")
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    sf.comm.current().barrier()  # "timeout": rank 0 never arrives
    return mapped


def ring_then_wait(marker: str) -> None:
    """After the hand-over, each rank writes its pid to ``marker``.<rank> and sleeps (until
    the test kills the launcher)."""
    mapped = _hand_over()
    rank = sf.comm.current().rank
    with open(f"{marker}.{rank}", "w") as f:
        f.write(f"{os.getpid()} {int(mapped)}")
    time.sleep(120)
