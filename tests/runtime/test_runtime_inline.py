"""A rank whose actors share one queue and talk to no other rank's actors, of a plan that allows
it (``Plan(inline=True)``), runs them on the calling thread: the same values, counters and
timeline as on queue threads, an actor's failure raised as on them, an abort from another rank
stopping it, and no thread started (docs/runtime.md, 'Actors and registers')."""

import threading
import time

import pytest
import torch

import sbpflow as sf
from sbpflow.comm import set_collective_stream
from sbpflow.runtime import ActorSpec, Input, Plan, Runtime

HANG = 30.0  # what a broken runtime would wait; the tests assert the run ended within PROMPT
PROMPT = 10.0


def _local_plan(log: list, inline: bool, fail_at: int | None = None,
                wait_for: threading.Event | None = None) -> Plan:
    """load -> square -> total on each of 2 ranks; logs each firing's thread; ``square`` fails
    at micro-batch ``fail_at``, once ``wait_for`` is set (and 0.1 s more)."""
    def load(mb):
        log.append(("load", threading.current_thread().name))
        return torch.tensor([float(mb + 1)])

    def square(mb, x):
        log.append(("square", threading.current_thread().name))
        if mb == fail_at:
            if wait_for is not None:
                wait_for.wait(HANG)
                time.sleep(0.1)
            raise ValueError(f"square failed at {mb}")
        return x * x

    def total(mb, x):
        return x

    specs = [ActorSpec("load", "load", load, queue="compute"),
             ActorSpec("square", "compute", square, inputs=["load"], outputs=1),
             ActorSpec("total", "compute", total, inputs=["square"])]
    return Plan({0: specs, 1: list(specs)}, name="inline", inline=inline)


@pytest.mark.parametrize("inline", [True, False])
def test_one_queue_runs_on_the_calling_thread_with_the_same_results(inline):
    log: list = []
    plan = _local_plan(log, inline)

    def body():
        rt = Runtime(plan)
        outs = [rt.run(4) for _ in range(2)]
        kinds = sorted({e["actor"] for e in rt.timeline()})
        return rt.inline, outs, rt.counters(), kinds, threading.current_thread().name

    res = sf.launch(body, world_size=2)
    for r, (ran_inline, outs, counters, kinds, me) in enumerate(res):
        assert ran_inline is inline
        for out in outs:
            assert [float(v) for v in out["total"]] == [1.0, 4.0, 9.0, 16.0]
        assert counters == {"load": 4, "square": 4, "total": 4}
        assert kinds == ["load", "square", "total"]
        threads = {name for _, name in log if name.startswith(f"sbpflow-rank{r}")
                   or name == me}
        assert threads == ({me} if inline else {f"sbpflow-rank{r}-compute"}), threads


def test_a_rank_reading_another_ranks_actor_or_on_two_queues_is_not_inline():
    one = ActorSpec("p", "load", lambda mb: mb)
    cross = Plan({0: [one], 1: [ActorSpec("c", "compute", lambda mb, x: x,
                                          inputs=[Input("p", rank=0)])]}, inline=True)
    two_queues = Plan({0: [one, ActorSpec("c", "compute", lambda mb, x: x, inputs=["p"])]},
                      inline=True)
    assert not cross.runs_inline(0) and not cross.runs_inline(1)
    assert not two_queues.runs_inline(0)
    assert not Plan({0: [ActorSpec("c", "compute", lambda mb: mb)]}).runs_inline(0)
    assert Plan({0: [ActorSpec("c", "compute", lambda mb: mb)]}, inline=True).runs_inline(0)


def test_an_inline_failure_is_the_actors_exception_and_aborts_the_other_rank():
    """Rank 1's actor fails; rank 0 waits, inline, in an all-reduce rank 1 never joins: the
    abort (taken by rank 0's reader thread) interrupts it within PROMPT s, not the timeout."""
    log: list = []
    entered = threading.Event()
    failing = _local_plan(log, True, fail_at=2, wait_for=entered).actors[1]

    def wait(mb):
        entered.set()  # (a stream's first call after the interrupt would not see it)
        return sf.comm.current().all_reduce(torch.ones(1), group=[0, 1])

    waiting = [ActorSpec("ar", "compute", _in_stream(wait))]
    plan = Plan({0: waiting, 1: failing}, name="inline-abort", inline=True)
    got, done = {}, threading.Event()

    def body():
        r = sf.comm.rank()
        rt = Runtime(plan, timeout=HANG)
        start = time.monotonic()
        try:
            rt.run(4)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            got[r] = (exc, time.monotonic() - start)
        # rank 1 stays until rank 0 stopped: a rank that returned would end the all-reduce
        # itself, not through the abort
        done.set() if r == 0 else done.wait(HANG)
        return rt.inline

    assert sf.launch(body, world_size=2, timeout=HANG) == [True, True]
    exc, _ = got[1]
    assert isinstance(exc, ValueError) and str(exc) == "square failed at 2"
    assert "raised by actor 'square' (compute, stage 0, micro-batch 2) on rank 1 (sbpflow " \
           "runtime)" in exc.__notes__
    other, seconds = got[0]
    assert isinstance(other, (sf.errors.ActorAborted, sf.errors.CommAborted)), other
    assert "actor 'square' (compute, stage 0, micro-batch 2) on rank 1 failed with " \
           "ValueError: square failed at 2" in str(other)
    assert seconds < PROMPT


def _in_stream(fn):
    """``fn`` with its collectives in a named stream (which the runtime's interrupt ends)."""
    def run(*args):
        previous = set_collective_stream("inline-test")
        try:
            return fn(*args)
        finally:
            set_collective_stream(previous)
    return run
