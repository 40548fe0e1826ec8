"""Progress records (`sbpflow.comm.progress`): three ranks' records in one real TCPStore, in this
process, and the text a timed-out collective's rank builds from them: what each rank does (its
collectives, its actor runs' threads, its last op) and which ranks it blames."""

from __future__ import annotations

import datetime
import re
import threading
import time

import pytest
import torch.distributed as dist

from sbpflow.comm.progress import P2P, Progress, group_key, period_for

PERIOD = 0.05


@pytest.fixture
def ranks():
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=10))
    made = [Progress(r, store, PERIOD) for r in range(3)]
    yield made
    for p in made:
        p.close()


def test_group_key_and_period():
    assert group_key((2, 0, 3)) == "0_2_3" and group_key([1], cuda=True) == "1/cuda"
    assert period_for(300) == 1.0 and period_for(2) == pytest.approx(0.2)


def test_enter_numbers_each_group_in_call_order(ranks):
    p = ranks[0]
    w, s = group_key(range(3)), group_key((0, 1))
    assert [p.enter(w, "barrier"), p.enter(s, "barrier"), p.enter(w, "barrier")] == [1, 1, 2]
    p.leave(w, 2)
    p.leave(w, 1)  # out of order: each closes its own
    p.leave(w, 1)  # a second leave changes nothing
    p.publish()
    g = ranks[1].read([0])[0]["groups"]
    assert (g[w]["n"], g[w]["open"], g[w]["last"][:2]) == (2, {}, [1, "barrier"])
    assert (g[s]["n"], list(g[s]["open"]), g[s]["last"]) == (1, ["1"], None)


def test_the_thread_publishes_changes_without_being_asked(ranks):
    key = group_key(range(3))
    ranks[2].enter(key, "all_reduce(sum)")
    deadline = time.monotonic() + 30  # expected within 2 periods; generous on a loaded machine
    while ranks[0].read([2])[2]["groups"].get(key, {}).get("n") != 1:
        assert time.monotonic() < deadline, "the record was never published"
        time.sleep(PERIOD)


def test_report_names_the_missing_rank_and_where_it_is(ranks):
    w, sub = group_key(range(3)), group_key((1, 2))
    for r in (0, 1, 2):  # collective #1 of the world: everyone did it
        ranks[r].leave(w, ranks[r].enter(w, "all_reduce(sum)"))
    for r in (0, 1):  # #2: rank 2 never comes
        ranks[r].enter(w, "all_gather")
    text = ranks[0].report(w, 2, [0, 1, 2])
    assert "rank(s) [2] did not arrive" in text and "arrived: [0, 1]" in text
    assert re.search(r"rank 2: entered #1 of that group last, in no collective for [\d.]+ s "
                     r"\(its last: all_reduce\(sum\) over ranks \[0, 1, 2\] #1\)", text), text
    # rank 2 is now stuck elsewhere: the report says in what
    ranks[2].enter(sub, "creating the process group")
    text = ranks[1].report(w, 2, [0, 1, 2])
    assert re.search(r"rank 2: .*inside creating the process group over ranks \[1, 2\] \(#1\) "
                     r"for [\d.]+ s", text), text
    assert "arrived: [0, 1]" in text


def test_report_without_a_record_and_after_close(ranks):
    w = group_key(range(4))
    ranks[0].enter(w, "barrier")
    text = ranks[0].report(w, 1, [0, 1, 3])  # rank 3 never made a communicator
    assert "rank(s) [1, 3] did not arrive" in text and "arrived: [0]" in text
    assert "rank 1: entered none of that group's collectives, no collective yet" in text
    assert "rank 3: entered none of that group's collectives, no progress record" in text
    ranks[1].close()
    assert "its communicator is closed" in ranks[0].report(w, 1, [0, 1])


def test_report_when_everyone_arrived_and_for_point_to_point(ranks):
    w = group_key(range(2))
    for r in (0, 1):
        ranks[r].enter(w, "barrier")
    assert "every member had entered it (ranks [0, 1])" in ranks[0].report(w, 1, [0, 1])
    ranks[2].enter(P2P, "exchange with ranks [1]")
    text = ranks[0].report(P2P, None, [1, 2])
    assert re.search(r"rank 1: inside barrier over ranks \[0, 1\] \(#1\) for [\d.]+ s; "
                     r"rank 2: inside exchange with ranks \[1\] \(#1\)", text), text


def _activity_of(ranks, r: int) -> str:
    """What rank ``r`` is doing, as a timeout report on another rank says it."""
    return ranks[(r + 1) % 3].report(P2P, None, [r])


def test_a_later_collective_does_not_close_an_earlier_open_one(ranks):
    """#1 is started asynchronously, #2 runs to its end: #1 is still open (a record keeping
    only the highest finished number said rank 0 was in no collective)."""
    w = group_key(range(3))
    p = ranks[0]
    first = p.enter(w, "all_reduce(sum)", waiting=False)
    p.leave(w, p.enter(w, "barrier"))
    text = _activity_of(ranks, 0)
    assert re.search(r"^rank 0: in no collective for [\d.]+ s \(its last: barrier over ranks "
                     r"\[0, 1, 2\] #2\): .*; all_reduce\(sum\) over ranks \[0, 1, 2\] \(#1\) "
                     r"started [\d.]+ s ago, not waited for yet$", text), text
    p.blocked(w, first)  # now the rank waits in it
    assert re.search(r"^rank 0: inside all_reduce\(sum\) over ranks \[0, 1, 2\] \(#1\) for "
                     r"[\d.]+ s$", _activity_of(ranks, 0))
    p.leave(w, first)
    assert "its last: all_reduce(sum) over ranks [0, 1, 2] #1)" in _activity_of(ranks, 0)


def test_synchronous_collective_open_under_a_finished_later_number(ranks):
    """The same with plain ``enter``: #1 is left after #2 finished; until then the rank is
    inside #1, whatever the highest finished number is."""
    w = group_key(range(3))
    p = ranks[1]
    first = p.enter(w, "all_gather")
    p.leave(w, p.enter(w, "barrier"))
    assert re.search(r"^rank 1: inside all_gather over ranks \[0, 1, 2\] \(#1\) for [\d.]+ s$",
                     _activity_of(ranks, 1))
    p.leave(w, first)
    assert "in no collective for" in _activity_of(ranks, 1)


def test_a_dropped_collective_is_closed_at_the_next_publication(ranks):
    """A `Pending` dropped unwaited: ``dropped`` (callable from a garbage collector's callback,
    it takes no lock) closes it at the next publication, without making it the last one
    finished; the thread publishes it by itself."""
    w = group_key(range(3))
    p = ranks[2]
    p.leave(w, p.enter(w, "barrier"))
    p.publish()
    p.dropped(w, p.enter(w, "all_reduce(sum)", waiting=False))
    with p._lock:  # the lock held (as when a collection runs inside it): dropped does not block
        p.dropped(w, 99)
    deadline = time.monotonic() + 30
    while ranks[0].read([2])[2]["groups"][w]["open"]:
        assert time.monotonic() < deadline, "the drop was never published"
        time.sleep(PERIOD)
    assert re.search(r"^rank 2: in no collective for [\d.]+ s \(its last: barrier over ranks "
                     r"\[0, 1, 2\] #1\): busy outside sbpflow's collectives, or calling "
                     r"different ones$", _activity_of(ranks, 2))
    p.dropped(w, p.enter(w, "all_reduce(sum)", waiting=False))
    p.enter(P2P, "exchange with ranks [0]")
    assert re.search(r"^rank 2: inside exchange with ranks \[0\] \(#1\) for [\d.]+ s$",
                     _activity_of(ranks, 2))


class _Run:
    """An actor run as `Activity` reads it: ``label()``, and ``doing()``: its label, start,
    threads inside an actor's function and the ranks whose messages it waits for."""

    def __init__(self, label: str, busy: list = (), peers: list = ()) -> None:
        self.text, self.busy, self.peers = label, list(busy), list(peers)
        self.began = time.perf_counter()

    def label(self) -> str:
        return self.text

    def doing(self) -> tuple:
        return self.text, self.began, self.busy, self.peers


def _inside_fwd(stage: int, seconds: float) -> tuple:
    """(thread, actor, micro-batch, since) of a compute thread inside 'fwd' for ``seconds``."""
    return (threading.current_thread(), f"actor 'fwd' (forward, stage {stage})", 1,
            time.perf_counter() - seconds)


def test_inquire_follows_the_waits_to_the_rank_stuck_in_an_actor(ranks):
    """Rank 0 waits for a message from rank 1, which waits in a receive from rank 2, whose
    compute thread has been inside an actor's function, out of communication, for 5 s: rank
    0's inquiry follows the waits and names rank 2 (its thread, actor, micro-batch, run) as
    the culprit; rank 1, waiting, is described but not blamed."""
    p0, p1, p2 = ranks
    p1.enter(P2P, "exchange with ranks [2]", members=[2])
    p2.activity.started(_Run("run 2 of plan 'p'", [_inside_fwd(2, 5.0)]))
    found = p0.inquire([1], threshold=1.0)
    assert found.culprits == (2,), found
    me = threading.current_thread().name
    assert re.search(r"^rank 1: inside exchange with ranks \[2\] \(#1\) for [\d.]+ s; rank 2: .*"
                     rf"in run 2 of plan 'p' for [\d.]+ s: its thread '{me}' is inside actor "
                     r"'fwd' \(forward, stage 2\), micro-batch 1, for [\d.]+ s, outside "
                     r"communication \(in its own code\); rank\(s\) \[2\] wait\(s\) for no other "
                     r"rank: the others wait for it$", found.text), found.text
    assert p0.inquire([1], threshold=60.0).culprits == ()  # not inside that long yet


def test_an_actor_run_waiting_for_messages_leads_to_the_rank_it_waits_for(ranks):
    """Rank 1 is in a run whose actors wait for rank 2's messages (no thread inside an actor,
    no collective: not stuck); rank 2 is out of any run and collective (its own code): the
    inquiry of rank 0, published by the ranks' threads without being asked, names rank 2.
    When rank 2's run waits for rank 0 instead, rank 0 (this rank), in no collective and no
    run, is the one named."""
    p0, p1, p2 = ranks
    p1.activity.started(_Run("run 3 of plan 'p'", peers=[2]))
    p2.activity.op = "relu"
    time.sleep(3 * PERIOD)  # the threads publish by themselves
    found = p0.inquire([1], threshold=0.0)
    assert re.search(r"^rank 1: no collective yet, .*; in run 3 of plan 'p' for [\d.]+ s: no "
                     r"actor inside its function \(waiting for messages from rank\(s\) \[2\]\); "
                     r"rank 2: no collective yet, .*; the last sbpflow op it started: 'relu'; "
                     r"rank\(s\) \[2\] wait\(s\) for no other rank", found.text), found.text
    assert found.culprits == (2,)
    p2.activity.started(_Run("run 3 of plan 'p'", peers=[0]))
    found = p0.inquire([1], threshold=0.0)
    assert found.culprits == (0,), found
    assert re.search(r"; rank 0 \(this rank\): no collective yet, [^;]*; rank\(s\) \[0\] wait",
                     found.text), found.text
