"""A run that talks to no other rank and runs inline fires, from its second run on, in the
order its last run fired (`sbpflow.runtime.firing_order`): the same values, timeline, counters and
sinks as the firing rule gives, each value dropped once its last reader read it, an actor's
failure raised as the rule's run raises it, and the run after a failure back on the rule.
A rank whose actors talk to another rank's never replays (docs/runtime.md, 'Actors and
registers')."""

import weakref

import pytest
import torch

import sbpflow as sf
from sbpflow.runtime import ActorSpec, Input, Plan, Runtime
from sbpflow.runtime import firing_order

_GENERATE = firing_order._program  # (the fixture below replaces it on the loop's side)
M = 8  # micro-batches a run
SLOTS = 2  # slots of the loader's registers: at most this many of its values are held


def _plan(live: list, fail: dict) -> Plan:
    """weights (once a run, read by every micro-batch) and load (two registers, one read by
    two actors) -> mul, neg, side -> acc (publishes once a run) and sinks. ``live`` gets, at
    each load, how many earlier loaded values are still alive; ``fail["at"]`` = (run,
    micro-batch) makes ``mul`` raise there."""
    made: list = []
    state = {"run": 0, "sum": None}

    def weights(mb):
        state["run"] += 1
        return torch.tensor([2.0, 3.0])

    def load(mb):
        live.append(sum(r() is not None for r in made))
        a = torch.full((2,), float(mb + 1))
        made.append(weakref.ref(a))
        return a, torch.tensor([float(10 * mb)])

    def mul(mb, a, w):
        if fail.get("at") == (state["run"], mb):
            raise ValueError(f"mul failed at micro-batch {mb}")
        return a * w

    def neg(mb, a):
        return -a

    def side(mb, b):
        return b + 1

    def acc(mb, x, y):
        state["sum"] = x + y if mb % M == 0 else state["sum"] + x + y
        return state["sum"].clone()

    specs = [ActorSpec("weights", "load", weights, queue="compute", times=1),
             ActorSpec("load", "load", load, queue="compute", outputs={"a": SLOTS, "b": SLOTS}),
             ActorSpec("mul", "compute", mul,
                       inputs=[Input("load", "a"), Input("weights", repeat=M)]),
             ActorSpec("neg", "compute", neg, inputs=[Input("load", "a")]),
             ActorSpec("side", "compute", side, inputs=[Input("load", "b")]),
             ActorSpec("acc", "compute", acc, inputs=["mul", "neg"], emit_every=M)]
    return Plan({0: specs}, name="replay", inline=True)


@pytest.fixture(autouse=True, params=["program", "loop"])
def _replay_by(request, monkeypatch):
    """Every test with the order generated at its first replay, and with the loop it runs
    by before that for a long order (`COMPILE_NOW`, `COMPILE_AFTER`)."""
    if request.param == "loop":
        monkeypatch.setattr(firing_order, "COMPILE_NOW", 0)
        monkeypatch.setattr(firing_order, "COMPILE_AFTER", 10 ** 9)
        monkeypatch.setattr(firing_order, "_program", None)  # (never called)


def _count_replays(monkeypatch) -> list:
    calls: list = []
    real = firing_order.FiringOrder.run

    def counted(self, run, split):
        calls.append(len(self.firings))
        return real(self, run, split)
    monkeypatch.setattr(firing_order.FiringOrder, "run", counted)
    return calls


def _order(rt: Runtime) -> list:
    return [(e["actor"], e["micro_batch"]) for e in rt.timeline()]


def test_a_replayed_run_equals_the_rule_s_run(monkeypatch):
    replays = _count_replays(monkeypatch)

    def body():
        live: list = []
        rt = Runtime(_plan(live, {}))
        runs = []
        for _ in range(3):
            live.clear()
            out = rt.run(M)
            runs.append((out, _order(rt), rt.counters(), list(live)))
        return rt.inline, runs

    inline, runs = sf.launch(body, world_size=1)[0]
    assert inline
    assert replays == [len(runs[0][1])] * 2  # runs 2 and 3 replayed every firing of run 1
    ruled = runs[0]
    for out, order, counters, live in runs[1:]:
        assert order == ruled[1]
        assert counters == ruled[2]
        assert sorted(out) == sorted(ruled[0]) == ["acc", "side"]
        for key in out:
            assert len(out[key]) == len(ruled[0][key])
            for got, want in zip(out[key], ruled[0][key]):
                assert torch.equal(got, want)
        assert live == ruled[3]
    # the sum over the run: sum over mb of (mb+1)*[2, 3] - (mb+1) = (mb+1)*[1, 2]
    want = sum(torch.tensor([1.0, 2.0]) * (mb + 1) for mb in range(M))
    assert torch.equal(runs[-1][0]["acc"][0], want)
    assert [float(v) for v in runs[-1][0]["side"]] == [10.0 * mb + 1 for mb in range(M)]


def test_a_replay_drops_each_value_after_its_last_reader():
    def body():
        live: list = []
        rt = Runtime(_plan(live, {}))
        rt.run(M)
        ruled = list(live)
        live.clear()
        rt.run(M)
        return ruled, list(live)

    ruled, replayed = sf.launch(body, world_size=1)[0]
    assert replayed == ruled
    # back-pressure holds at most SLOTS of the loader's values (and the one made last);
    # holding every value to the run's end would reach M - 1
    assert max(replayed) <= SLOTS + 1 < M - 1


def test_a_failure_in_a_replay_names_the_actor_and_the_next_run_takes_the_rule(monkeypatch):
    replays = _count_replays(monkeypatch)

    def body():
        fail: dict = {}
        rt = Runtime(_plan([], fail))
        first = rt.run(M)
        fail["at"] = (2, 3)  # the second run, replayed, fails at micro-batch 3
        with pytest.raises(ValueError, match="mul failed at micro-batch 3") as info:
            rt.run(M)
        notes = " ".join(getattr(info.value, "__notes__", []))
        fail.clear()
        third, fourth = rt.run(M), rt.run(M)
        return first, third, fourth, notes

    first, third, fourth, notes = sf.launch(body, world_size=1)[0]
    assert "actor 'mul'" in notes and "micro-batch 3" in notes and "rank 0" in notes
    assert len(replays) == 2  # run 2 (failed) and run 4; run 3 fired by the rule
    for out in (third, fourth):
        for key in first:
            assert all(torch.equal(a, b) for a, b in zip(out[key], first[key]))


def test_a_rank_talking_to_another_never_replays(monkeypatch):
    replays = _count_replays(monkeypatch)

    def make(mb):
        return torch.tensor([float(mb)])

    def double(mb, x):
        return 2 * x
    plan = Plan({0: [ActorSpec("make", "load", make, queue="compute")],
                 1: [ActorSpec("double", "compute", double,
                               inputs=[Input("make", rank=0)])]}, name="talk", inline=True)

    def body():
        rt = Runtime(plan)
        return [rt.run(4) for _ in range(3)]

    res = sf.launch(body, world_size=2)
    assert [float(v) for v in res[1][-1]["double"]] == [0.0, 2.0, 4.0, 6.0]
    assert replays == []


def test_a_long_order_is_generated_after_its_first_replays(monkeypatch):
    """An order longer than COMPILE_NOW firings replays by the loop COMPILE_AFTER times, then
    by its generated function, with the same results."""
    monkeypatch.setattr(firing_order, "COMPILE_NOW", 0)
    monkeypatch.setattr(firing_order, "COMPILE_AFTER", 2)
    made: list = []

    def counted(firings):
        made.append(len(firings))
        return _GENERATE(firings)
    monkeypatch.setattr(firing_order, "_program", counted)

    def body():
        rt = Runtime(_plan([], {}))
        out = []
        for _ in range(5):
            out.append((rt.run(M)["acc"][0], _order(rt)))
            out[-1] += (len(made),)
        return out

    runs = sf.launch(body, world_size=1)[0]
    # run 1 by the rule, 2 and 3 by the loop, 4 and 5 by the function made before run 4
    assert [n for _, _, n in runs] == [0, 0, 0, 1, 1]
    assert made == [len(runs[0][1])]
    for acc, order, _ in runs[1:]:
        assert torch.equal(acc, runs[0][0]) and order == runs[0][1]
