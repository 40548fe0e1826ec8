"""Rank processes: start them, watch them, stop them, and name the root cause of a failure.

See docs/internals.md, 'Rank processes'.
"""

from __future__ import annotations

import math
import multiprocessing.connection
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import CommAborted

__all__ = ["PRIORITY", "EXIT_COMM", "Report", "RankProcess", "Outcome", "run_ranks",
           "CommandRank"]

# lower: more likely the root cause. A timeout names the ranks that did not arrive; a plain
# comm_error (a connection closed) is mostly what a peer's exit left behind.
PRIORITY = {"error": 0, "dead": 1, "comm_timeout": 2, "comm_error": 3}
EXIT_COMM = 3      # a command rank's exit code when it failed in a collective (`CommandRank`)
_STOP_WAIT = 5.0   # s a terminated rank gets to exit before it is killed


@dataclass(frozen=True)
class Report:
    """How one rank ended: ``kind`` ``"ok"`` or a key of `PRIORITY`; ``payload`` its result
    (ok) or what failed (an exception, an exit code); ``detail`` its traceback, if it sent one."""

    kind: str
    payload: Any = None
    detail: str = ""


class RankProcess:
    """One started rank, as `run_ranks` watches it. A subclass sets ``self.proc`` (its process:
    ``terminate()`` and ``kill()`` signal it) and says how the rank reports."""

    proc: Any

    def waitables(self) -> list:
        """Objects `multiprocessing.connection.wait` accepts that become ready when the rank
        may have something to report; ``[]``: look at it every ``tick`` instead."""
        return []

    def report(self) -> Report | None:
        """How the rank ended, once it has (asked no more after that); None while it runs."""
        raise NotImplementedError

    def is_alive(self) -> bool:
        raise NotImplementedError

    def join(self, timeout: float | None) -> None:
        """Wait up to ``timeout`` s (None: for ever) for the process to exit."""
        raise NotImplementedError

    def terminate(self) -> None:
        self.proc.terminate()

    def kill(self) -> None:
        self.proc.kill()

    def close(self) -> None:
        """Release what the watcher holds (pipes) once the process has exited."""


@dataclass
class Outcome:
    """What `run_ranks` saw. ``reports[r]``: rank r's `Report`, None if it never made one;
    ``failed``: the ranks that failed, in the order seen; ``stopped``: the ranks still running
    at the end, terminated; ``unfinished``: the ranks still running when ``bound`` ran out
    before any failure."""

    reports: list
    failed: list = field(default_factory=list)
    stopped: list = field(default_factory=list)
    unfinished: list = field(default_factory=list)

    @property
    def root(self) -> int | None:
        """The root-cause rank: the first failure seen of the lowest `likelihood` (None:
        none)."""
        if not self.failed:
            return None
        return min(self.failed, key=lambda r: likelihood(self.reports[r]))  # first of ties


def likelihood(report: Report) -> float:
    """How unlikely ``report`` is the root cause (lower: likelier): its kind's `PRIORITY`,
    except that a communication failure whose exception names culprits (``culprits`` of a
    `CommError`: the ranks that did not arrive, or that wait for no other rank, from their
    progress records) comes before the other communication failures, which are often a
    consequence (a connection a peer's exit closed) or could not tell who held them up; and
    among those naming culprits, the rank's own failure before an abort relayed from another
    rank (`CommAborted`, which repeats that rank's failure); and a rank's own timeout before
    a connection another rank's timeout closed (which names the same culprits, and may be
    reported first)."""
    level = PRIORITY[report.kind]
    if level >= PRIORITY["comm_timeout"] and getattr(report.payload, "culprits", ()):
        if isinstance(report.payload, CommAborted):
            return PRIORITY["comm_timeout"] - 0.25
        return PRIORITY["comm_timeout"] - (0.5 if report.kind == "comm_timeout" else 0.4)
    return level


def run_ranks(start: Callable[[int], RankProcess], world_size: int, *, grace: float,
              settle: float = 0.0, bound: float | None = None, tick: float = 1.0,
              linger: float = 0.0) -> Outcome:
    """Start ranks ``start(0) … start(world_size - 1)``, watch them until every one reported,
    or a failure's ``grace`` / ``settle`` (module doc) or ``bound`` s ran out; then stop those
    still running and read the reports of those that ended meanwhile. After an all-ok run each
    rank first gets ``linger`` s to exit by itself (its teardown). ``tick`` is the longest wait
    between two looks at the ranks. Every rank started is stopped and closed on return, also
    when starting one raises (or on KeyboardInterrupt)."""
    procs: list[RankProcess] = []
    try:
        for r in range(world_size):
            procs.append(start(r))
        watch = _Watch(procs, grace, settle, bound)
        watch.run(tick)
        if not watch.out.failed and not watch.out.unfinished:
            for p in procs:
                p.join(linger)
        watch.out.stopped = _stop(procs)
        watch.sweep()
        return watch.out
    finally:
        _stop(procs)
        for p in procs:
            p.close()


class _Watch:
    """The watching loop of `run_ranks`: which ranks are pending and when to give up."""

    def __init__(self, procs: list, grace: float, settle: float, bound: float | None) -> None:
        self.procs, self.grace, self.settle = procs, grace, settle
        self.out = Outcome([None] * len(procs))
        self.pending = set(range(len(procs)))
        self.give_up = time.monotonic() + (math.inf if bound is None else bound)

    def run(self, tick: float) -> None:
        while self.pending:
            left = self.give_up - time.monotonic()
            if left <= 0:
                if not self.out.failed:
                    self.out.unfinished = sorted(self.pending)
                return
            self._wait(min(left, tick))
            for r in sorted(self.pending):
                self._look(r)

    def _wait(self, timeout: float) -> None:
        waits = [self.procs[r].waitables() for r in sorted(self.pending)]
        if all(waits):
            multiprocessing.connection.wait([w for ws in waits for w in ws], timeout=timeout)
        else:  # some rank can only be polled
            time.sleep(timeout)

    def _look(self, r: int) -> None:
        report = self.procs[r].report()
        if report is None:
            return
        self.pending.discard(r)
        self.out.reports[r] = report
        if report.kind == "ok":
            return
        now = time.monotonic()
        if not self.out.failed:
            self.give_up = min(self.give_up, now + self.grace)
        if PRIORITY[report.kind] < PRIORITY["comm_timeout"]:   # not a communication failure
            self.give_up = min(self.give_up, now + self.settle)
        self.out.failed.append(r)

    def sweep(self) -> None:
        """Read the ranks that ended by themselves after the last look (not the stopped ones):
        such a rank's failure may be the root cause."""
        for r in sorted(self.pending - set(self.out.stopped)):
            self._look(r)
        self.out.unfinished = [r for r in self.out.unfinished if r in self.pending]


def _stop(procs: list[RankProcess]) -> list[int]:
    """Terminate the ranks still running, kill those not gone `_STOP_WAIT` s later, wait for
    all; the ranks that were terminated."""
    stopped = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in stopped:
        procs[r].terminate()
    for p in procs:
        p.join(_STOP_WAIT)
        if p.is_alive():
            p.kill()
            p.join(None)
    return stopped


class CommandRank(RankProcess):
    """A rank that is a command (`subprocess.Popen` of ``args`` with ``env``), whose exit code
    is its report: 0 ok, `EXIT_COMM` a ``comm_error``, any other an ``error``; the payload is
    the exit code."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(args, env=env)

    def report(self) -> Report | None:
        code = self.proc.poll()
        if code is None:
            return None
        kind = "ok" if code == 0 else "comm_error" if code == EXIT_COMM else "error"
        return Report(kind, code)

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def join(self, timeout: float | None) -> None:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
