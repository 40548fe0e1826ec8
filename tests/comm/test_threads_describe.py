"""What a timed-out collective on the threads backend says of the ranks it waits for: a rank
whose own thread does not wait but one of its `waits_alongside` threads does (an actor's recv
thread, a ZeRO worker) is named with that thread's wait, not as "not waiting"; a rank whose
actor thread is stuck in its own code is named with that thread, its actor and micro-batch,
also when the wait that timed out is for a rank that waits for it."""

import re
import threading
import time

import pytest
import torch

import sbpflow as sf
from sbpflow.comm import current
from sbpflow.comm.threads import waits_alongside
from stuck_fns import stuck_step, wake

TIMEOUT = 2.0
HELPER = "sbpflow-test-alongside"


def _rank_1_waits_alongside_only() -> None:
    """Rank 0 receives from rank 1, which never sends; rank 1's own thread waits for a helper
    thread (outside any collective) that, marked alongside, receives from rank 0. Rank 1's
    helper starts a second after rank 0's recv, so rank 0 times out while the helper waits."""
    c = current()
    if c.rank == 0:
        c.recv((1,), torch.float32, src=1)
        return
    world = c.world
    give_up = time.monotonic() + 30
    while not world.blocked.get(0) and time.monotonic() < give_up:  # rank 0 is in its recv
        time.sleep(0.01)
    time.sleep(TIMEOUT / 2)
    def helper():
        waits_alongside(True)
        try:
            c.recv((1,), torch.float32, src=0)
        except sf.CommError:  # the abort after rank 0's timeout ends this wait
            pass

    t = threading.Thread(target=helper, name=HELPER, daemon=True)
    t.start()
    t.join(30)


def test_a_timeout_names_the_alongside_wait_of_the_rank_it_waits_for():
    """Rank 1's only waiting thread is alongside (it waits for rank 0 while rank 0 waits for
    rank 1: no deadlock is reported, the cycle check ignores such waits); rank 0's
    `CommTimeout` says what that thread waits in and for whom."""
    with pytest.raises(sf.errors.CommTimeout) as info:
        sf.launch(_rank_1_waits_alongside_only, world_size=2, timeout=TIMEOUT)
    msg = str(info.value)
    assert msg.startswith("recv from rank 1 on rank 0 timed out"), msg
    assert f"rank 1's thread '{HELPER}' waits in recv from rank 0 for rank(s) [0]" in msg, msg
    assert "not waiting" not in msg, msg


def test_a_timeout_names_the_compute_thread_of_a_stuck_pipeline_stage():
    """A 3-stage pipeline graph, a thread rank a stage; the last stage's compute thread sleeps
    inside its forward actor. Ranks 0 and 1 wait for gradients (rank 0 for rank 1, which waits
    for rank 2): the timeout follows the waits to rank 2 and names its compute thread, the
    actor and the micro-batch, where it is, and rank 2 as the culprit (before: rank 2 as 'not
    waiting', or through another of its threads' waits)."""
    wake(False)
    try:
        with pytest.raises(sf.CommError) as info:
            sf.launch(stuck_step, world_size=3, args=("pipeline", 2), timeout=TIMEOUT)
    finally:
        wake()
    msg = str(info.value)
    assert info.value.culprits == (2,), msg
    assert re.search(r"rank 2's thread 'sbpflow-rank2-compute' is inside actor 'fwd' \(forward, "
                     r"stage 2\), micro-batch 0, of run 2 of plan '[^']+', for [\d.]+ s, not "
                     r"waiting for another rank \(it is at _nap \(", msg), msg
