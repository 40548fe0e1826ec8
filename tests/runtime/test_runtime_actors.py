"""The actor runtime on one rank: the firing rule, slot reuse, counters, emit_every / repeat,
sinks, repeated runs and the plan's checks (sbpflow/runtime, docs/runtime.md 'Actors and
registers')."""

import threading
import time

import pytest
import torch

import sbpflow as sf
from sbpflow.runtime import ActorSpec, Input, Plan, Runtime


def _run(plan, m, **kw):
    rt = Runtime(plan, **kw)
    return rt, rt.run(m)


def _by(events, actor):
    return sorted((e for e in events if e["actor"] == actor), key=lambda e: e["micro_batch"])


def test_values_follow_the_registers_like_plain_torch():
    xs = torch.randn(5, 3, dtype=torch.float64)
    w = torch.randn(3, 3, dtype=torch.float64)
    plan = Plan({0: [
        ActorSpec("load", "load", lambda mb: xs[mb]),
        ActorSpec("mm", "forward", lambda mb, x: x @ w, inputs=["load"]),
        ActorSpec("act", "compute", lambda mb, x, y: torch.tanh(y) + x, inputs=["load", "mm"]),
    ]})
    rt, out = _run(plan, 5)
    assert list(out) == ["act"]
    for mb in range(5):
        torch.testing.assert_close(out["act"][mb], torch.tanh(xs[mb] @ w) + xs[mb], rtol=0,
                                   atol=0)
    assert rt.counters() == {"load": 5, "mm": 5, "act": 5}
    assert [e["micro_batch"] for e in _by(rt.timeline(), "act")] == list(range(5))


@pytest.mark.parametrize("slots", [1, 2, 3])
def test_a_producer_runs_at_most_its_slot_count_ahead(slots):
    """Producer k + slots may start only after the consumer finished (acked) value k: a slot is
    reused only after its ack; and with that many slots it does run ahead."""
    plan = Plan({0: [
        ActorSpec("p", "load", lambda mb: mb, outputs=slots),
        # 0.2 s: the data thread fills every slot within c's first firing on a loaded machine
        ActorSpec("c", "compute", lambda mb, x: time.sleep(0.2) or x, inputs=["p"]),
    ]})
    rt, out = _run(plan, 6)
    assert out["c"] == list(range(6))
    p, c = _by(rt.timeline(), "p"), _by(rt.timeline(), "c")
    for k in range(6 - slots):
        assert p[k + slots]["start"] >= c[k]["end"], (k, slots)
    # the producer is on the data thread, the consumer on compute: p runs ahead by `slots`
    assert p[slots - 1]["end"] <= c[0]["end"]


def test_an_actor_fires_only_when_every_input_is_readable():
    plan = Plan({0: [
        ActorSpec("fast", "load", lambda mb: mb),
        ActorSpec("slow", "compute", lambda mb: time.sleep(0.01) or 10 * mb, queue="other"),
        ActorSpec("sum", "forward", lambda mb, a, b: a + b, inputs=["fast", "slow"]),
    ]})
    rt, out = _run(plan, 4)
    assert out["sum"] == [11 * mb for mb in range(4)]
    slow, s = _by(rt.timeline(), "slow"), _by(rt.timeline(), "sum")
    assert all(s[k]["start"] >= slow[k]["end"] for k in range(4))


def test_accumulate_then_update_once_a_run():
    """emit_every: the accumulator publishes after its M-th firing; the update fires once and
    its result is read by every micro-batch of the next part (repeat)."""
    m = 4
    grads = torch.randn(m, 3, dtype=torch.float64)
    acc = {"sum": torch.zeros(3, dtype=torch.float64)}

    def accumulate(mb, g):
        acc["sum"] = acc["sum"] + g
        return acc["sum"]

    plan = Plan({0: [
        ActorSpec("bwd", "backward", lambda mb: grads[mb]),
        ActorSpec("acc", "compute", accumulate, inputs=["bwd"], emit_every=m),
        ActorSpec("update", "update", lambda mb, g: -0.1 * g, inputs=["acc"], times=1),
        ActorSpec("use", "forward", lambda mb, u: u * mb, inputs=[Input("update", repeat=m)]),
    ]})
    rt, out = _run(plan, m)
    assert rt.counters() == {"bwd": m, "acc": m, "update": 1, "use": m}
    step = -0.1 * grads.sum(0)
    for mb in range(m):
        torch.testing.assert_close(out["use"][mb], step * mb)
    upd, use = _by(rt.timeline(), "update"), _by(rt.timeline(), "use")
    assert upd[0]["start"] >= _by(rt.timeline(), "acc")[-1]["end"]
    assert all(u["start"] >= upd[0]["end"] for u in use)


def test_several_registers_and_sink_names():
    plan = Plan({0: [
        ActorSpec("split", "compute", lambda mb: (mb, -mb), outputs={"pos": 1, "neg": 2}),
        ActorSpec("twice", "compute", lambda mb, x: 2 * x, inputs=[Input("split", "pos")]),
    ]})
    _, out = _run(plan, 3)
    assert out == {"split.neg": [0, -1, -2], "twice": [0, 2, 4]}


def test_repeated_runs_reset_counters_and_leak_no_threads():
    before = set(threading.enumerate())
    plan = Plan({0: [ActorSpec("a", "load", lambda mb: mb),
                     ActorSpec("b", "compute", lambda mb, x: x + 1, inputs=["a"])]})
    rt = Runtime(plan)
    for m in (3, 1, 5):
        assert rt.run(m) == {"b": [x + 1 for x in range(m)]}
        assert rt.counters() == {"a": m, "b": m}
        assert len(rt.timeline()) == 2 * m
    kept = set(threading.enumerate()) - before  # one thread a queue, kept between runs
    assert sorted(t.name for t in kept) == ["sbpflow-rank0-compute", "sbpflow-rank0-data"]
    rt.close()
    for t in kept:
        t.join(5)
    assert set(threading.enumerate()) == before


def test_events_have_the_documented_fields():
    plan = Plan({0: [ActorSpec("a", "load", lambda mb: time.sleep(0.002), stage=3)]})
    rt, _ = _run(plan, 2)
    ev = rt.timeline()
    assert [sorted(e) for e in ev] == [sorted(["rank", "actor", "kind", "stage", "micro_batch",
                                               "start", "end"])] * 2
    assert ev[0]["stage"] == 3 and ev[0]["kind"] == "load" and ev[0]["rank"] == 0
    assert ev[0]["end"] - ev[0]["start"] >= 0.002 and ev[1]["start"] >= ev[0]["end"]


def _fn(mb, *x):
    return mb


@pytest.mark.parametrize("actors, needle", [
    ({0: [ActorSpec("a", "kernel", _fn)]}, "unknown kind 'kernel'"),
    ({0: [ActorSpec("a", "load", _fn), ActorSpec("a", "load", _fn)]}, "two actors named 'a'"),
    ({0: [ActorSpec("a", "compute", _fn, inputs=["nope"])]}, "actor 'nope' on rank 0"),
    ({0: [ActorSpec("p", "load", _fn), ActorSpec("a", "compute", _fn, inputs=[Input("p", "x")])]},
     "registers are ['out']"),
    ({0: [ActorSpec("a", "load", _fn, outputs=0)]}, "at least 1 slot"),
    ({0: [ActorSpec("a", "load", _fn, emit_every=0)]}, "emit_every"),
    ({0: [ActorSpec("p", "load", _fn), ActorSpec("a", "compute", _fn,
                                                 inputs=[Input("p", repeat=0)])]}, "repeat"),
])
def test_inconsistent_plans_are_refused(actors, needle):
    with pytest.raises(sf.errors.PlanError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        Plan(actors)


def test_rates_that_do_not_match_are_refused_at_run():
    plan = Plan({0: [ActorSpec("p", "load", _fn, times=2),
                     ActorSpec("c", "compute", _fn, inputs=["p"])]})
    with pytest.raises(sf.errors.PlanError, match="'c' on rank 0 fires 3 times.*publishes 2 values"):
        Runtime(plan).run(3)
    with pytest.raises(sf.errors.PlanError, match="micro_batches must be an int >= 1"):
        Runtime(plan).run(0)


def test_a_plan_on_ranks_outside_the_world_is_refused():
    plan = Plan({0: [ActorSpec("p", "load", _fn)], 3: [ActorSpec("q", "load", _fn)]})
    with pytest.raises(sf.errors.PlanError, match=r"ranks \[3\], outside the world of 1"):
        Runtime(plan)


def test_wrong_number_of_outputs_fails_as_the_actor():
    plan = Plan({0: [ActorSpec("two", "compute", lambda mb: 1, outputs={"a": 1, "b": 1})]})
    with pytest.raises(sf.errors.PlanError, match="2 output registers") as info:
        Runtime(plan).run(1)
    assert any("actor 'two' (compute, stage 0, micro-batch 0) on rank 0" in n
               for n in info.value.__notes__)


def test_describe_names_registers_and_consumers():
    plan = Plan({0: [ActorSpec("p", "load", _fn, outputs=3)],
                 1: [ActorSpec("c", "forward", _fn, stage=1, inputs=[Input("p", rank=0)])]})
    text = plan.describe(0)
    assert "p (load, stage 0, data thread)" in text and "out[3 slots] -> c@1" in text
    assert "reads p.out@0" in plan.describe(1) and "the caller" in plan.describe(1)


def test_loading_compute_and_communication_overlap_on_their_own_threads():
    """A load (data thread) -> forward (compute thread) -> send (comm thread) chain of 0.2 s
    kernels: each stage works on the next micro-batch while the next stage works on this one,
    so the run takes about (M + 2) kernels, not 3M (kernels long beside a loaded machine's
    scheduling delays)."""
    t, m = 0.2, 5
    plan = Plan({0: [ActorSpec("load", "load", lambda mb: time.sleep(t) or mb),
                     ActorSpec("fwd", "forward", lambda mb, x: time.sleep(t) or x,
                               inputs=["load"]),
                     ActorSpec("send", "send", lambda mb, x: time.sleep(t) or x,
                               inputs=["fwd"])]})
    rt, out = _run(plan, m)
    assert out["send"] == list(range(m))
    ev = rt.timeline()
    load, fwd, send = _by(ev, "load"), _by(ev, "fwd"), _by(ev, "send")
    def overlap(a, b):
        return a["start"] < b["end"] and b["start"] < a["end"]

    # send k runs beside forward k + 1, forward k beside load k + 1 (most k: a delayed wake-up
    # on a loaded machine may shift one pair, the span below still proves the pipelining)
    assert sum(overlap(send[k], fwd[k + 1]) for k in range(m - 1)) >= m - 2
    assert sum(overlap(fwd[k], load[k + 1]) for k in range(m - 1)) >= m - 2
    span = max(e["end"] for e in ev) - min(e["start"] for e in ev)
    assert span < 0.75 * 3 * m * t
