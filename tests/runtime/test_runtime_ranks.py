"""The actor runtime across 2-4 thread ranks: req / ack over the message channel, values
copied between ranks, a slot freed by the acks of every rank, early messages kept for the next
run, collectives inside actors, and the channel itself (Communicator.post / inbox)."""

import threading
import time

import torch

import sbpflow as sf
from sbpflow.comm import current
from sbpflow.runtime import ActorSpec, Input, Plan, Runtime


def _on_ranks(plan, m, world, runs=1):
    def body():
        rt = Runtime(plan)
        outs = [rt.run(m) for _ in range(runs)]
        return outs, rt.timeline(), rt.counters(), current().stats()["message"]
    return sf.launch(body, world_size=world)


def test_a_chain_through_four_ranks_equals_plain_torch():
    xs = torch.randn(6, 4, dtype=torch.float64)
    ws = [torch.randn(4, 4, dtype=torch.float64) for _ in range(4)]
    plan = Plan({
        0: [ActorSpec("load", "load", lambda mb: xs[mb]),
            ActorSpec("f0", "forward", lambda mb, x: x @ ws[0], inputs=["load"])],
        **{r: [ActorSpec(f"f{r}", "forward", lambda mb, x, r=r: torch.relu(x) @ ws[r],
                         stage=r, inputs=[Input(f"f{r - 1}", rank=r - 1)])] for r in (1, 2, 3)},
    })
    res = _on_ranks(plan, 6, 4)
    want = [torch.relu(torch.relu(torch.relu(xs[mb] @ ws[0]) @ ws[1]) @ ws[2]) @ ws[3]
            for mb in range(6)]
    got = res[3][0][0]["f3"]
    for mb in range(6):
        torch.testing.assert_close(got[mb], want[mb], rtol=0, atol=0)
    assert [r[2] for r in res] == [{"load": 6, "f0": 6}, {"f1": 6}, {"f2": 6}, {"f3": 6}]
    # every value crossing a rank is counted as message bytes, once sent and once received
    nb = 6 * 4 * 8
    assert res[0][3].sent == nb and res[3][3].recv == nb and res[1][3].sent == nb


def test_a_value_sent_to_another_rank_is_a_copy():
    """The producer changes its tensor in place after publishing: the consumer on another
    rank still reads the value it was sent (the local consumer shares the slot, by design)."""
    buf = torch.zeros(3)

    def produce(mb):
        buf.fill_(mb)
        return buf

    def consume(mb, x):
        time.sleep(0.02)  # the producer has refilled buf meanwhile (2 slots)
        return x.clone()

    plan = Plan({0: [ActorSpec("p", "load", produce)],
                 1: [ActorSpec("c", "compute", consume, inputs=[Input("p", rank=0)])]})
    res = _on_ranks(plan, 4, 2)
    assert [float(v[0]) for v in res[1][0][0]["c"]] == [0.0, 1.0, 2.0, 3.0]


def test_a_slot_is_free_only_after_every_rank_acked():
    """One producer on rank 0 with one slot, three consumers on ranks 1-3 of different
    speeds, summed back on rank 0: value k+1 is made only after all three finished value k."""
    plan = Plan({
        0: [ActorSpec("p", "load", lambda mb: torch.tensor([float(mb)]), outputs=1),
            ActorSpec("sum", "compute", lambda mb, *xs: sum(xs),
                      inputs=[Input(f"c{r}", rank=r) for r in (1, 2, 3)])],
        **{r: [ActorSpec(f"c{r}", "compute",
                         lambda mb, x, r=r: time.sleep(0.003 * r) or x * r,
                         inputs=[Input("p", rank=0)])] for r in (1, 2, 3)},
    })
    res = _on_ranks(plan, 5, 4)
    assert [float(v) for v in res[0][0][0]["sum"]] == [6.0 * mb for mb in range(5)]
    p = sorted((e for e in res[0][1] if e["actor"] == "p"), key=lambda e: e["micro_batch"])
    ends = {}
    for r in (1, 2, 3):
        for e in res[r][1]:
            ends.setdefault(e["micro_batch"], []).append(e["end"])
    for k in range(4):
        assert p[k + 1]["start"] >= max(ends[k]), k


def test_ranks_of_different_speeds_over_several_runs():
    """Rank 1 ends each run with a slow actor, while rank 0 (done once its values are acked)
    starts the next run and posts to rank 1: those messages reach rank 1 during its previous
    run, are kept, and every run's results are right."""
    plan = Plan({
        0: [ActorSpec("p", "load", lambda mb: mb, outputs=4)],
        1: [ActorSpec("c", "compute", lambda mb, x: x * 10, inputs=[Input("p", rank=0)]),
            # 1 s: room for rank 0 to finish and start the next run on a loaded machine
            ActorSpec("tail", "compute", lambda mb, x: time.sleep(1.0 * (mb == 4)) or x + 1,
                      inputs=["c"])],
    })

    def body():
        rt = Runtime(plan)
        outs, starts, ends = [], [], []
        for _ in range(4):
            outs.append(rt.run(5))
            starts.append(min(e["start"] for e in rt.timeline()))
            ends.append(max(e["end"] for e in rt.timeline()))
        return outs, starts, ends

    res = sf.launch(body, world_size=2)
    assert res[1][0] == [{"tail": [10 * k + 1 for k in range(5)]}] * 4
    assert res[0][0] == [{}] * 4
    # rank 0 began runs 2-4 before rank 1 had finished the run before
    assert all(res[0][1][n + 1] < res[1][2][n] for n in range(3))


def test_a_collective_actor_uses_the_ranks_communicator():
    """Actors run on runtime threads; a collective among them reaches the rank's world."""
    xs = torch.randn(3, 2, 5, dtype=torch.float64)  # [micro-batch, rank, ...]

    def reduce(mb, x):
        return current().all_reduce(x, group=[0, 1])

    plan = Plan({r: [ActorSpec("x", "load", lambda mb, r=r: xs[mb, r]),
                     ActorSpec("ar", "collective", reduce, inputs=["x"])] for r in (0, 1)})
    res = _on_ranks(plan, 3, 2)
    for r in (0, 1):
        for mb in range(3):
            torch.testing.assert_close(res[r][0][0]["ar"][mb], xs[mb, 0] + xs[mb, 1])


def test_no_thread_left_after_a_cross_rank_run():
    deadline = time.monotonic() + 5  # earlier tests' queue threads end once their ranks have
    while any(t.name.startswith("sbpflow-rank") for t in threading.enumerate()) and \
            time.monotonic() < deadline:
        time.sleep(0.01)
    before = set(threading.enumerate())
    plan = Plan({0: [ActorSpec("p", "load", lambda mb: mb)],
                 1: [ActorSpec("c", "compute", lambda mb, x: x, inputs=[Input("p", rank=0)])]})
    _on_ranks(plan, 3, 2, runs=2)
    deadline = time.monotonic() + 10  # the rank threads of launch end after their results
    while set(threading.enumerate()) != before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert set(threading.enumerate()) == before


def test_channel_messages_arrive_in_order_from_any_sender():
    def body():
        c = current()
        for k in range(50):
            c.post(0, "t", (c.rank, k))
        if c.rank:
            return None
        got = []
        while len(got) < 150:
            got += c.inbox("t", 1.0)
        assert c.inbox("t", 0.0) == []
        return got

    got = sf.launch(body, world_size=3)[0]
    for r in range(3):
        mine = [m for src, m in got if src == r]
        assert all(m[0] == r for m in mine) and [m[1] for m in mine] == list(range(50))


def test_channel_inbox_waits_at_most_its_timeout():
    def body():
        c = current()
        t = time.monotonic()
        got = c.inbox("empty", 0.2)
        return got, time.monotonic() - t

    (got, dt), = sf.launch(body, world_size=1)
    assert got == [] and 0.15 < dt < 1.0


def test_values_posted_before_the_receivers_runtime_exists_keep_their_order():
    """Threads backend: reqs go to the receiving run directly once its runtime exists; those
    posted before (through the channel) are taken then, so the order holds: value 0 is posted
    before rank 1 makes its runtime, value 1 after, both before its run starts."""
    def produce(mb):
        time.sleep(0.2)
        return torch.tensor([float(mb)])

    plan = Plan({0: [ActorSpec("p", "load", produce, outputs=4)],
                 1: [ActorSpec("c", "compute", lambda mb, x: x.clone(),
                               inputs=[Input("p", rank=0)])]})

    def body():
        if current().rank == 0:
            return Runtime(plan).run(3)
        time.sleep(0.3)  # value 0 went through the channel
        rt = Runtime(plan)
        time.sleep(0.3)  # value 1 was handed over directly, kept for the run
        return [float(v) for v in rt.run(3)["c"]]

    assert sf.launch(body, world_size=2)[1] == [0.0, 1.0, 2.0]
