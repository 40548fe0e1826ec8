"""`sbpflow.comm.processes.run_ranks`, the one process launcher's watching policy: which failure
is the root cause, how long the other ranks get, who is stopped. Scripted ranks (no processes)
for the timing, then real commands (`CommandRank`)."""

from __future__ import annotations

import sys
import time

import pytest

from sbpflow.comm.local_world import rank_env
from sbpflow.comm.processes import (EXIT_COMM, CommandRank, RankProcess, Report,
                                     run_ranks)
from sbpflow.errors import CommAborted, CommError, CommTimeout

# Upper time bounds are generous (a loaded CI machine delays the watcher by seconds): what a
# wrong policy would wait (a grace, a rank that never ends) lasts HANG s, or forever; the run
# must end within PROMPT. Lower bounds (the policy waited what it should) are exact.
HANG = 30.0
PROMPT = 10.0


class Scripted(RankProcess):
    """A rank that reports ``report`` ``at`` s after it started (never, if ``at`` is None);
    ``after_stop``: its report is readable only once some rank was terminated (it ended between
    the watcher's last look and the stop). Terminated ranks never report."""

    stops: list = []  # ranks terminated, shared by the ranks of one run

    def __init__(self, report: Report | None = None, at: float | None = 0.0,
                 after_stop: bool = False) -> None:
        self.rep, self.at, self.after_stop = report, at, after_stop
        self.t0, self.terminated, self.closed, self.joined = time.monotonic(), False, False, []

    def _ended(self) -> bool:
        return self.at is not None and time.monotonic() >= self.t0 + self.at

    def waitables(self) -> list:
        return []

    def report(self) -> Report | None:
        if self.terminated or not self._ended() or (self.after_stop and not self.stops):
            return None
        return self.rep

    def is_alive(self) -> bool:
        return not self.terminated and not self._ended()

    def terminate(self) -> None:
        self.terminated = True
        self.stops.append(self)

    def kill(self) -> None:
        raise AssertionError("a terminated scripted rank is gone at once")

    def join(self, timeout: float | None) -> None:
        self.joined.append(timeout)

    def close(self) -> None:
        self.closed = True


def _run(ranks: list[Scripted], **policy):
    Scripted.stops = []
    t0 = time.monotonic()
    out = run_ranks(lambda r: ranks[r], len(ranks), tick=0.01, **policy)
    assert all(p.closed for p in ranks)
    return out, time.monotonic() - t0


OK, ERR, COMM, DEAD = (Report("ok", "result"), Report("error", ValueError("own")),
                       Report("comm_error", "comm"), Report("dead", "gone"))


def test_all_ok_results_in_rank_order_and_linger():
    ranks = [Scripted(Report("ok", r), at=0.02 * (3 - r)) for r in range(4)]
    out, took = _run(ranks, grace=HANG, linger=HANG)
    assert [rep.payload for rep in out.reports] == [0, 1, 2, 3]
    assert out.root is None and out.failed == out.stopped == out.unfinished == []
    assert all(p.joined[0] == HANG for p in ranks)  # each got `linger` to tear down
    assert took < PROMPT


def test_a_root_cause_after_its_consequence_is_found_and_stops_the_run_at_once():
    """sf.launch's policy (settle 0): rank 1's comm_error first, rank 2's own error 0.2 s
    later; the run ends then (not after the HANG s grace) with rank 2 as the root cause."""
    ranks = [Scripted(at=None), Scripted(COMM, 0.0), Scripted(ERR, 0.2), Scripted(at=None)]
    out, took = _run(ranks, grace=HANG)
    assert out.root == 2 and out.failed == [1, 2] and out.stopped == [0, 3]
    assert ranks[0].terminated and ranks[3].terminated and not ranks[2].terminated
    assert 0.2 <= took < PROMPT


def test_only_consequences_wait_the_grace_then_the_first_is_named():
    ranks = [Scripted(COMM, 0.1), Scripted(at=None), Scripted(COMM, 0.0)]
    out, took = _run(ranks, grace=0.5)
    assert out.root == 2 and out.failed == [2, 0] and out.stopped == [1]
    assert 0.5 <= took < PROMPT  # rank 1 never ends


def test_error_beats_dead_beats_comm_error_and_settle_keeps_watching():
    """The command line's policy (settle = grace): after a root cause the others still get
    ``settle`` s (from the first failure) for their own messages; a later error outranks an
    earlier dead rank; ties go to the first seen."""
    ranks = [Scripted(COMM, 0.0), Scripted(DEAD, 0.05), Scripted(ERR, 0.15),
             Scripted(ERR, 0.25), Scripted(at=None)]
    out, took = _run(ranks, grace=0.6, settle=0.6)
    assert out.failed == [0, 1, 2, 3] and out.root == 2 and out.stopped == [4]
    assert 0.6 <= took < PROMPT  # rank 4 never ends
    dead_first = [Scripted(COMM, 0.0), Scripted(DEAD, 0.05), Scripted(at=None)]
    assert _run(dead_first, grace=0.3)[0].root == 1


def test_a_timeout_beats_the_closed_connection_it_left_behind():
    """Rank 1 times out and exits; rank 0's pending collective then fails with a closed
    connection and may report first: the timeout (it names who did not arrive) is the root
    cause, and neither ends the grace early (both are communication failures)."""
    timeout = Report("comm_timeout", "timed out")
    ranks = [Scripted(COMM, 0.0), Scripted(timeout, 0.05), Scripted(at=None)]
    out, took = _run(ranks, grace=0.3)
    assert out.failed == [0, 1] and out.root == 1 and out.stopped == [2]
    assert 0.3 <= took < PROMPT
    later_error = [Scripted(timeout, 0.0), Scripted(ERR, 0.05), Scripted(at=None)]
    assert _run(later_error, grace=0.3)[0].root == 1


def test_a_rank_that_ended_between_the_last_look_and_the_stop_is_read():
    """Rank 2 fails on its own just as the grace runs out (its report shows only after the
    stop): it is the root cause, not rank 0's comm_error, and it was not stopped."""
    ranks = [Scripted(COMM, 0.0), Scripted(at=None), Scripted(ERR, 0.0, after_stop=True)]
    out, _ = _run(ranks, grace=0.2)
    assert out.failed == [0, 2] and out.root == 2 and out.stopped == [1]


def test_bound_names_the_unfinished_ranks():
    ranks = [Scripted(Report("ok", 0), 0.0), Scripted(at=None), Scripted(at=None)]
    out, took = _run(ranks, grace=HANG, bound=0.3)
    assert out.unfinished == [1, 2] == out.stopped and out.root is None
    assert 0.3 <= took < PROMPT  # ranks 1 and 2 never end


def test_a_rank_that_cannot_start_stops_those_started():
    started = [Scripted(at=None), Scripted(at=None)]

    def start(r: int) -> Scripted:
        if r == 2:
            raise OSError("no more processes")
        return started[r]

    Scripted.stops = []
    with pytest.raises(OSError, match="no more processes"):
        run_ranks(start, 4, grace=1.0)
    assert all(p.terminated and p.closed for p in started)


def test_command_ranks_exit_codes():
    """Real processes: rank 0 fails in a 'collective' (EXIT_COMM) at once, rank 1 on its own
    0.3 s later, rank 2 would run a minute: rank 1 is the root cause, rank 2 is stopped."""
    bodies = [f"import sys; sys.exit({EXIT_COMM})",
              "import sys, time; time.sleep(0.3); sys.exit(5)", "import time; time.sleep(60)",
              "pass"]
    t0 = time.monotonic()
    out = run_ranks(lambda r: CommandRank([sys.executable, "-c", bodies[r]], {}), 4,
                    grace=1.0, settle=1.0, tick=0.05)
    assert out.root == 1 and out.failed == [0, 1] and out.stopped == [2]
    assert [rep and (rep.kind, rep.payload) for rep in out.reports] == \
        [("comm_error", EXIT_COMM), ("error", 5), None, ("ok", 0)]
    assert time.monotonic() - t0 < PROMPT  # rank 2 would run 60 s


def test_rank_env_is_torchruns():
    assert rank_env(2, 4, 1234) == {"RANK": "2", "LOCAL_RANK": "2", "WORLD_SIZE": "4",
                                    "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1",
                                    "MASTER_PORT": "1234"}


def _naming(exc: Exception, *culprits: int) -> Exception:
    exc.culprits = culprits
    return exc


def test_a_failure_that_names_its_culprits_beats_the_consequences():
    """Rank 0's closed connection and rank 1's timeout name no culprit; rank 3's abort relays
    another rank's failure, naming rank 4; rank 2's own timeout names rank 4 (from the
    progress records), later than all of them: rank 2 is the root cause, before the relay.
    A rank's own error still beats them all."""
    closed = Report("comm_error", CommError("Connection closed by peer"))
    blind = Report("comm_timeout", CommTimeout("timed out"))
    named = Report("comm_timeout", _naming(CommTimeout("rank(s) [4] did not arrive"), 4))
    relay = Report("comm_error", _naming(CommAborted("rank 2 failed with ..."), 4))
    ranks = [Scripted(closed, 0.0), Scripted(blind, 0.0), Scripted(named, 0.1),
             Scripted(relay, 0.05), Scripted(at=None)]
    out, _ = _run(ranks, grace=0.4)
    assert out.failed == [0, 1, 3, 2] and out.root == 2
    relayed_only = [Scripted(closed, 0.0), Scripted(relay, 0.05), Scripted(at=None)]
    assert _run(relayed_only, grace=0.3)[0].root == 1
    own_error = [Scripted(named, 0.0), Scripted(ERR, 0.05), Scripted(at=None)]
    assert _run(own_error, grace=0.3)[0].root == 1
    # a connection rank 1's timeout closed names the same culprit, reported first: the
    # timeout is the root cause
    closed_named = Report("comm_error", _naming(CommError("Connection closed by peer"), 4))
    first_closed = [Scripted(closed_named, 0.0), Scripted(named, 0.05), Scripted(at=None)]
    out, _ = _run(first_closed, grace=0.3)
    assert out.failed == [0, 1] and out.root == 1
