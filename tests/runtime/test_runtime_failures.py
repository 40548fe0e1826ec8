"""Failures of the actor runtime on thread ranks: a failing actor stops every rank within 2 s
and the caller gets its own exception naming rank and actor; a waiting actor times out naming
itself and the register; no thread is left behind (docs/runtime.md 'Actors and registers')."""

import threading
import time

import pytest

import sbpflow as sf
from sbpflow.runtime import ActorSpec, Input, Plan, Runtime, pipeline_plan

# Timing asserts leave room for a loaded 2-core CI machine (seconds of scheduling delay): what
# a broken runtime would wait (a stuck actor, a collective or actor timeout) lasts HANG s or
# more (the default timeout is 300 s), and the test asserts the run ended within PROMPT s.
HANG = 30.0
PROMPT = 10.0


def _sleeper(t):
    return lambda mb, *x: time.sleep(t) or mb


class Boom(ValueError):
    pass


def _recording(plan, m, log, timeout=None):
    """A rank body that runs ``plan`` and logs, per rank, the exception and when run ended."""
    def body():
        rank = sf.comm.rank()
        try:
            return Runtime(plan, timeout=timeout).run(m)
        except BaseException as exc:
            log[rank] = (exc, time.monotonic())
            raise
    return body


def test_a_failing_actor_stops_every_rank_and_the_caller_gets_it():
    stages, m, log, failed = 4, 8, {}, {}

    def bwd2(mb, saved, grad):
        time.sleep(0.005)
        if mb == 3:
            failed["at"] = time.monotonic()
            failed["exc"] = Boom("boom at micro-batch 3")
            raise failed["exc"]
        return mb

    bwd = [_sleeper(0.005)] * stages
    bwd[2] = bwd2
    plan = pipeline_plan([_sleeper(0.005)] * stages, bwd, m, "1f1b")
    before = set(threading.enumerate())
    with pytest.raises(Boom) as info:
        sf.launch(_recording(plan, m, log), world_size=stages)
    exc = info.value
    assert exc is failed["exc"]  # the original exception object
    assert "raised by actor 'bwd2' (backward, stage 2, micro-batch 3) on rank 2 (sbpflow " \
           "runtime)" in exc.__notes__
    assert "raised on rank 2 of 4 (sbpflow threads backend)" in exc.__notes__
    assert sorted(log) == [0, 1, 2, 3]
    for r in (0, 1, 3):
        other, at = log[r]
        # ActorAborted from rank 2's abort message; rarely CommAborted, when the world's abort
        # (a rank raised in launch) is seen first: both name the actor and its exception
        assert isinstance(other, sf.errors.CommAborted), (r, other)
        assert "actor 'bwd2' (backward, stage 2, micro-batch 3) on rank 2 failed with Boom: " \
               "boom at micro-batch 3" in str(other)
        assert at - failed["at"] < PROMPT
    assert log[2][0] is exc
    # the failed runs' queue threads end once closed (after a failure) or once their rank
    # thread has ended (launch's): within a fraction of a second
    _wait_for(lambda: set(threading.enumerate()) - before == set())
    assert set(threading.enumerate()) - before == set()


def test_a_rank_inside_a_long_actor_stops_when_it_returns():
    """Rank 1 is inside a 0.5 s actor when rank 0 fails: it stops once the actor returns,
    within 2 s of the failure, without firing again."""
    log, failed = {}, {}

    def fail(mb):
        time.sleep(0.1)
        failed["at"] = time.monotonic()
        raise Boom("load failed")

    plan = Plan({0: [ActorSpec("load", "load", fail)],
                 1: [ActorSpec("slow", "compute", _sleeper(0.5)),
                     ActorSpec("after", "compute", _sleeper(0), inputs=["slow"])]})
    with pytest.raises(Boom, match="load failed"):
        sf.launch(_recording(plan, 3, log), world_size=2)
    exc, at = log[1]
    assert isinstance(exc, sf.errors.ActorAborted) and "actor 'load' (load, stage 0, micro-batch 0)" \
        " on rank 0 failed with Boom: load failed" in str(exc)
    assert 0.3 < at - failed["at"] < PROMPT


def test_an_actor_stuck_in_its_function_is_left_behind_after_the_grace():
    log, release, entered = {}, threading.Event(), threading.Event()

    def stuck(mb):
        entered.set()
        return release.wait(HANG) and mb

    # rank 0 fails only once rank 1 is inside its actor (else the abort can reach rank 1
    # before it fires, and nothing is left behind: a race under load)
    plan = Plan({0: [ActorSpec("load", "load", lambda mb: entered.wait(HANG) and 1 / 0)],
                 1: [ActorSpec("stuck", "compute", stuck)]})
    t = time.monotonic()
    try:
        with pytest.raises(ZeroDivisionError):
            sf.launch(_recording(plan, 2, log), world_size=2)
        assert time.monotonic() - t < PROMPT  # waiting for the stuck actor takes HANG
    finally:
        release.set()
    exc, _ = log[1]
    assert isinstance(exc, sf.errors.ActorAborted)
    assert any("threads ['sbpflow-rank1-compute'] still inside actor(s) ['stuck'] 0.75 s after "
               "the failure, left behind" in n for n in exc.__notes__)


def test_a_missing_input_times_out_naming_the_actor_and_register(monkeypatch):
    """Rank 1 never runs its part: rank 0's consumer waits for register p.out of rank 1."""
    monkeypatch.setenv("SBPFLOW_TIMEOUT", "0.3")
    plan = Plan({0: [ActorSpec("c", "forward", _sleeper(0), stage=1,
                               inputs=[Input("p", rank=1)])],
                 1: [ActorSpec("p", "forward", _sleeper(0))]})

    def body():
        return Runtime(plan).run(2) if sf.comm.rank() == 0 else None

    t = time.monotonic()
    with pytest.raises(sf.errors.ActorTimeout) as info:
        sf.launch(body, world_size=2)
    assert 0.3 <= time.monotonic() - t < PROMPT
    msg = str(info.value)
    assert msg.startswith("actor 'c' (forward, stage 1) on rank 0 waited ")
    assert "for input register p.out of rank 1 (no req for value 0 yet); it fired 0 of 2 " \
           "times (timeout 0.3 s, SBPFLOW_TIMEOUT)" in msg


def test_no_free_slot_times_out_naming_the_output_register():
    """The consumer is busy (not waiting) with value 0; the producer, with one slot, waits
    for it to be acked."""
    plan = Plan({0: [ActorSpec("p", "load", _sleeper(0), outputs=1),
                     ActorSpec("c", "compute", _sleeper(1.0), inputs=["p"])]})
    with pytest.raises(sf.errors.ActorTimeout) as info:
        Runtime(plan, timeout=0.3).run(3)
    assert "actor 'p' (load, stage 0) on rank 0 waited" in str(info.value)
    assert "for a free slot of its output register 'out' (1 slots: slot 0 (value 0) not " \
           "acked by 'c' on rank 0); it fired 1 of 3 times" in str(info.value)


def test_missing_acks_time_out_and_abort_the_other_rank():
    """Rank 0 (timeout 0.3 s) waits for the ack of a consumer busy for 1 s on rank 1 (timeout
    HANG s, so the consumer does not time out inside its function first)."""
    log = {}
    plan = Plan({0: [ActorSpec("p", "load", _sleeper(0))],
                 1: [ActorSpec("c", "compute", _sleeper(1.0), inputs=[Input("p", rank=0)])]})
    bodies = [_recording(plan, 1, log, timeout=0.3), _recording(plan, 1, log, timeout=HANG)]
    with pytest.raises(sf.errors.ActorTimeout) as info:
        sf.launch(lambda: bodies[sf.comm.rank()](), world_size=2)
    assert "actor 'p' (load, stage 0) on rank 0 waited" in str(info.value)
    assert "for the acks of its output register 'out' (slot 0 (value 0) not acked by 'c' on " \
           "rank 1); it fired 1 of 1 times" in str(info.value)
    other = log[1][0]
    assert isinstance(other, sf.errors.ActorAborted) and str(other).startswith(
        "rank 0 failed with ActorTimeout: actor 'p' (load, stage 0) on rank 0 waited")


def test_a_rank_failing_outside_the_runtime_stops_the_others():
    log = {}
    plan = Plan({0: [ActorSpec("c", "compute", _sleeper(0), inputs=[Input("p", rank=1)])],
                 1: [ActorSpec("p", "load", _sleeper(0))]})
    inner = _recording(plan, 2, log)

    def body():
        if sf.comm.rank() == 1:
            time.sleep(0.1)
            log["at"] = time.monotonic()
            raise Boom("before the run")
        return inner()

    with pytest.raises(Boom, match="before the run"):
        sf.launch(body, world_size=2)
    exc, at = log[0]
    assert isinstance(exc, sf.errors.CommAborted) and "Boom: before the run" in str(exc)
    assert at - log["at"] < PROMPT


def _wait_for(done, seconds: float = 3.0) -> None:
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_no_thread_is_left_after_failed_runs():
    before = set(threading.enumerate())
    plan = Plan({0: [ActorSpec("a", "load", _sleeper(0)),
                     ActorSpec("b", "compute", lambda mb, x: 1 / (mb - 2), inputs=["a"])]})
    rt = Runtime(plan)
    for _ in range(3):
        with pytest.raises(ZeroDivisionError) as info:
            rt.run(4)
        assert "raised by actor 'b' (compute, stage 0, micro-batch 2) on rank 0 (sbpflow " \
               "runtime)" in info.value.__notes__
        assert rt.counters() == {"a": 3, "b": 2} or rt.counters() == {"a": 4, "b": 2}
    assert rt.run(2) == {"b": [-0.5, -1.0]}  # the runtime is usable again
    rt.close()  # its queue threads are kept between runs until then
    _wait_for(lambda: set(threading.enumerate()) - before == set())
    assert set(threading.enumerate()) - before == set()
