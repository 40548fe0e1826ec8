"""Runs after a failed run, and failures the runtime must survive (docs/runtime.md 'Actors and
registers', 'Failures'): a thread left behind inside a collective refuses the next run instead
of pairing with it; a fresh Runtime on the same plan never reads the previous one's messages; a
failing post fails the run with its own error; busy and repeat-read waits time out right; one
reader thread a channel, kept from run to run."""

import threading
import time

import pytest
import torch

import sbpflow as sf
from sbpflow.comm.channels import ThreadChannels
from sbpflow.runtime import ActorSpec, Input, Plan, Runtime, engine, pipeline_plan

HANG = 30.0  # what a broken runtime would wait; the tests assert the run ended within PROMPT
PROMPT = 10.0


def _outcome(fn):
    try:
        return ("ok", fn())
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return (type(exc).__name__, str(exc))


def test_a_collective_left_behind_refuses_the_next_run_instead_of_pairing_with_it():
    """Rank 1's load fails while rank 0's all_reduce (micro-batch 0) waits for it: that thread
    is left behind. Rank 1's next all_reduce would pair with it and both ranks would get wrong
    values; instead rank 0 refuses the run and rank 1's aborts."""
    first, entered = {"run": True}, threading.Event()

    def load(mb):
        r = sf.comm.rank()
        if r == 1 and first["run"]:
            entered.wait(HANG)  # rank 0's all_reduce of micro-batch 0 is (about to be) waiting
            time.sleep(0.1)
            raise ValueError("load failed")
        return torch.tensor([100.0 * r + mb])

    def reduce(mb, x):
        if sf.comm.rank() == 0:
            entered.set()
        return sf.comm.current().all_reduce(x, group=[0, 1])

    plan = Plan({r: [ActorSpec("x", "load", load),
                     ActorSpec("ar", "collective", reduce, inputs=["x"])] for r in (0, 1)})

    def body():
        rt = Runtime(plan, timeout=HANG)
        one = _outcome(lambda: rt.run(3))
        time.sleep(1.5)  # both ranks' failed runs are over (0.75 s grace)
        first["run"] = False
        two = _outcome(lambda: [float(v) for v in rt.run(3)["ar"]])
        return one, two

    (one0, two0), (one1, two1) = sf.launch(body, world_size=2, timeout=HANG)
    assert one0[0] == "ActorAborted" and one1[0] == "ValueError"
    assert two0[0] == "CommError" and "rank 0 cannot start run 2 of plan 'plan'" in two0[1]
    assert "sbpflow-rank0-comm (inside actor(s) ['ar'])" in two0[1]
    assert two1[0] == "ActorAborted" and "rank 0 cannot start run 2" in two1[1]


def test_a_fresh_runtime_on_the_same_plan_never_reads_the_previous_ones_messages():
    """Rank 0's slow producer publishes (posts a req) after rank 1's failed run ended: the
    next Runtime of rank 1 must not take it for its own run's value 0."""
    inside = threading.Event()

    def slow(mb):
        inside.set()
        time.sleep(0.3)
        return torch.full((2,), 100.0 + mb)

    def fail(mb):
        inside.wait(HANG)  # rank 0 publishes value 0 after this run ended on rank 1
        raise ValueError("boom")

    def consumer(mb, x):
        return x.clone()

    bad = Plan({0: [ActorSpec("p", "load", slow)],
                1: [ActorSpec("c", "compute", consumer, inputs=[Input("p", rank=0)]),
                    ActorSpec("x", "load", fail, times=1)]})
    good = Plan({0: [ActorSpec("p", "load", lambda mb: torch.full((2,), float(mb)))],
                 1: [ActorSpec("c", "compute", consumer, inputs=[Input("p", rank=0)]),
                     ActorSpec("x", "load", lambda mb: None, times=1)]})

    def body():
        one = _outcome(lambda: Runtime(bad).run(4))
        time.sleep(1.0)  # rank 0's late req has arrived in rank 1's channel
        out = Runtime(good).run(4)
        return one[0], [float(v[0]) for v in out.get("c", [])]

    (one0, _), (one1, values) = sf.launch(body, world_size=2)
    assert {one0, one1} == {"ActorAborted", "ValueError"}
    assert values == [0.0, 1.0, 2.0, 3.0]


def test_a_post_failing_with_a_non_comm_error_fails_the_run_with_that_error(monkeypatch):
    """A post raising RuntimeError (a dead c10d store) must fail the run naming it, not break
    the runtime's lock ('release unlocked lock'). (On the threads backend reqs and acks are
    handed over directly, which cannot fail so: they go through the channel here, as on the
    torch backend.)"""
    monkeypatch.setattr(engine, "_direct", lambda *a: None)
    orig = ThreadChannels.post

    def post(self, src, dst, channel, msg):
        if src == 0 and msg[0] == "req" and msg[5] == 2:
            raise RuntimeError("Broken pipe (simulated dead c10d store)")
        return orig(self, src, dst, channel, msg)

    monkeypatch.setattr(ThreadChannels, "post", post)
    plan = Plan({0: [ActorSpec("p", "load", lambda mb: torch.zeros(2))],
                 1: [ActorSpec("c", "compute", lambda mb, x: x, inputs=[Input("p", rank=0)])]})
    got = sf.launch(lambda: _outcome(lambda: Runtime(plan, timeout=HANG).run(6)),
                    world_size=2)
    assert got[0][0] == "CommError"
    assert "posting a 'req' message to rank 1" in got[0][1] and "Broken pipe" in got[0][1]
    assert got[1][0] == "ActorAborted" and "Broken pipe" in got[1][1]


def test_an_actor_busy_longer_than_the_timeout_times_out():
    release = threading.Event()
    plan = Plan({0: [ActorSpec("p", "load", lambda mb: release.wait(HANG) and mb)]})
    t = time.monotonic()
    try:
        with pytest.raises(sf.errors.ActorTimeout) as info:
            Runtime(plan, timeout=0.5).run(1)
        assert time.monotonic() - t < PROMPT  # the broken runtime waits HANG s
    finally:
        release.set()
    assert str(info.value).startswith("actor 'p' (load, stage 0) on rank 0 has been inside its "
                                      "function for ")
    assert "(micro-batch 0); it fired 0 of 1 times (timeout 0.5 s" in str(info.value)


def test_gpipe_flush_waiting_through_the_backward_is_not_a_timeout():
    """The flush's one value is acked after the last backward: its wait (6 x 0.5 s of
    backward) is longer than the 2 s timeout, but each backward reading it is progress."""
    def sleeper(t):
        return lambda mb, *a: time.sleep(t) or mb

    plan = pipeline_plan([sleeper(0.01)] * 2, [sleeper(0.5)] * 2, 6, "gpipe", name="gp")
    out = sf.launch(lambda: Runtime(plan, timeout=2.0).run(6), world_size=2)
    assert out[0]["bwd0"] == list(range(6))


def test_one_reader_a_channel_from_run_to_run_ended_with_its_runtimes():
    """The channel's reader is one thread for every run, a failed one included; it hands each
    run its own values (never the next run's, which it keeps), the runs after the failure do
    the start handshake, and the reader ends once the channel's runtime is closed."""
    def load(mb):
        if sf.comm.rank() == 0 and state["fail"] and mb == 1:
            raise ValueError("boom")
        return torch.full((2,), 10.0 * state["run"] + mb)

    state = {"fail": False, "run": 0}
    plan = Plan({0: [ActorSpec("p", "load", load)],
                 1: [ActorSpec("c", "compute", lambda mb, x: x.clone(),
                               inputs=[Input("p", rank=0)])]})

    def body():
        rank, rt = sf.comm.rank(), Runtime(plan, timeout=HANG)
        name = f"sbpflow-rank{rank}-inbox"
        before = set(threading.enumerate())  # an earlier test's reader may still be ending
        got = []
        for run, fail in enumerate([False, True, False, False]):
            sf.comm.current().barrier(group=[0, 1])
            state["fail"], state["run"] = fail, run
            out = _outcome(lambda: rt.run(3))
            got.append(out[0] if out[0] != "ok" else [float(v[0]) for v in out[1].get("c", [])])
        readers = [t for t in threading.enumerate() if t.name == name and t not in before]
        rt.close()
        deadline = time.monotonic() + 10  # the reader ends soon after close: poll for it
        left = [None]
        while left and time.monotonic() < deadline:
            time.sleep(0.05)
            left = [t for t in threading.enumerate() if t.name == name and t not in before]
        return got, len(readers), len(left)

    got = sf.launch(body, world_size=2, timeout=HANG)
    assert got[0][0] == [[], "ValueError", [], []]
    assert got[1][0] == [[0.0, 1.0, 2.0], "ActorAborted", [20.0, 21.0, 22.0], [30.0, 31.0, 32.0]]
    assert [g[1:] for g in got] == [(1, 0), (1, 0)]


def test_runs_reuse_their_objects_and_each_run_starts_as_a_first():
    """A run that ended well leaves its actors and registers to the next run on the same plan
    and micro-batch count, reset: every run fires each actor its times in order, gives its own
    values and timeline, takes a function replaced in a spec between runs, and a failed run's
    objects are never reused (the run after it still gives the right values); a new
    micro-batch count gets new objects. Two ranks: the reqs and acks cross ranks."""
    fail = {"on": False}

    def make(mb):
        return torch.tensor([10.0 * sf.comm.rank() + mb])

    def add(mb, x):
        if fail["on"] and sf.comm.rank() == 1:
            raise ValueError("consumer failed")
        return x + 1

    plan = Plan({0: [ActorSpec("x", "load", make)],
                 1: [ActorSpec("y", "compute", add, inputs=[Input("x", rank=0)], outputs=1)]})

    def body():
        rt = Runtime(plan, timeout=HANG)
        out = []
        for k in (3, 3, 2, 2):
            got = rt.run(k)
            out.append(([float(v) for v in got.get("y", [])], sorted(rt.counters().items()),
                        [e["micro_batch"] for e in rt.timeline()]))
        kept = rt._run
        spec = plan.spec(sf.comm.rank(), "y" if sf.comm.rank() else "x")
        old = spec.fn
        spec.fn = (lambda mb, *a: old(mb, *a) * 2)  # read again by the next run
        out.append([float(v) for v in rt.run(2).get("y", [])])
        spec.fn = old
        out.append(rt._run is kept)
        fail["on"] = True
        out.append(_outcome(lambda: rt.run(2))[0])
        failed = rt._run
        time.sleep(1.0)  # (both ranks' failed runs are over)
        fail["on"] = False
        out.append([float(v) for v in rt.run(2).get("y", [])])
        out.append(rt._run is not failed)
        return out

    r0, r1 = sf.launch(body, world_size=2, timeout=HANG)
    assert r1[0] == ([1.0, 2.0, 3.0], [("y", 3)], [0, 1, 2])
    assert r1[1] == r1[0] and r0[1] == r0[0] == ([], [("x", 3)], [0, 1, 2])
    assert r1[2] == r1[3] == ([1.0, 2.0], [("y", 2)], [0, 1])
    assert r1[4] == [2.0, 6.0]  # (2 mb + 1) x 2: both functions doubled
    assert r0[5] is True and r1[5] is True
    assert r1[6] == "ValueError" and r0[6] == "ActorAborted"
    assert r1[7] == [1.0, 2.0] and r0[8] is True and r1[8] is True
