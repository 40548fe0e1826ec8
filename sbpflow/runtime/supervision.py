"""The failure supervision of one run on one rank: `RunSupervisor`.

It records the run's first failure (`RunSupervisor.fail`: the culprit's rank and actor noted
on the exception, every thread of the run woken, the rank's waiting collectives interrupted,
an ``abort`` to the plan's other ranks), times out an actor that waits, or stays inside its
function, longer than the runtime's timeout (`ActorTimeout` naming the actor, its rank and
stage, explained with what the plan's ranks are doing), stops the run's threads (bounded
after a failure; those left inside an actor are remembered on the communicator's state) and
refuses a run while such a thread lives: its collective would pair with the new run's.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ..errors import ActorAborted, ActorTimeout, CommError
from .actors import Actor
from .workers import Job

__all__ = ["RunSupervisor"]

_POLL = 0.05  # s between the supervisor's timeout checks
_STOP_GRACE = 0.75  # s a failed run waits for its threads (an actor may be inside its fn);
# below the 1 s `launch` gives a failed world, so a rank reports what its runtime says


class RunSupervisor:
    """The supervision of one run (``run``, a `_PlanRun`): ``failure``, the run's first
    (``None`` while it goes well). It writes ``run.over`` under ``run.lock`` and reads the
    run's actors; it tells the other ranks through ``run.mail``."""

    def __init__(self, run: Any) -> None:
        self.run, self.rank = run, run.rank
        self.failure: BaseException | None = None

    def fail(self, exc: BaseException, actor: Actor | None, index: int | None = None,
             broadcast: bool = True) -> None:
        """Record the run's first failure, wake every thread, tell the other ranks."""
        run = self.run
        where = f"rank {self.rank}"
        if actor is not None:
            where = (f"actor {actor.name!r} ({actor.spec.kind}, stage {actor.spec.stage}, "
                     f"micro-batch {index}) on rank {self.rank}")
            if hasattr(exc, "add_note"):
                exc.add_note(f"raised by {where} (sbpflow runtime)")
        with run.lock:
            if actor is not None:
                actor.busy = False
            first = self.failure is None
            if first:
                self.failure, run.over = exc, True
                run.rt.shared.failed = True
                # the run's threads waiting in a collective or receive give up now (threads
                # backend): a peer that failed will never join it
                run.comm.interrupt(f"{run.label()} failed ({type(exc).__name__}: {exc})")
                for c in run.conds.values():
                    c.notify_all()
                run.main.notify_all()
        if first and broadcast:
            text = f"{where} failed with {type(exc).__name__}: {exc}"
            if isinstance(exc, ActorAborted):
                text = str(exc)
            culprits = tuple(getattr(exc, "culprits", ()))
            run.mail.tell_peers(("abort", run.run_id, text, culprits))

    def refuse_if_stale(self) -> None:
        """Refuse the run (`CommError`, and tell the other ranks, whose run aborts) while a
        thread a failed run left behind is inside an actor: a collective of that thread would
        pair with this run's and give every rank wrong values."""
        run = self.run
        stale = run.rt.shared.alive()
        if stale:
            problem = (f"rank {self.rank} cannot start {run.label()}: threads {stale} of a "
                       f"failed run are still running (their collectives would pair with this "
                       f"run's); wait until they return (at most the communication timeout) "
                       f"and run again")
            run.mail.tell_peers(("start", run.run_id, problem))
            raise CommError(problem)

    # -- timeouts -----------------------------------------------------------------------------
    def supervise(self) -> None:
        """Wait until every actor finished (or the run failed), checking for timeouts."""
        run, exc = self.run, None
        with run.lock:
            while not run.over and run.left:
                exc = self.wait(run.main)
                if exc is not None:
                    break
            run.over = True
        if exc is not None:
            self.fail(self.explained(exc), None)

    def wait(self, cond: threading.Condition) -> ActorTimeout | None:
        """Wait on ``cond`` (of ``run.lock``, held) one poll at most; then, unless the run is
        over, the `ActorTimeout` of the first actor past the timeout (`timed_out`)."""
        cond.wait(_POLL)
        return None if self.run.over else self.timed_out()

    def explained(self, exc: ActorTimeout) -> ActorTimeout:
        """``exc`` with what the plan's ranks are doing, and as its ``culprits`` those that
        wait for no other rank for half the timeout at least (inside an actor's own code, or
        not in the run): `Communicator.whereabouts` (call without the lock: the torch backend
        waits for the ranks' progress records)."""
        rt = self.run.rt
        found = self.run.comm.whereabouts(rt.plan.ranks, rt.timeout / 2)
        if not found.text:
            return exc
        err = ActorTimeout(f"{exc}; the plan's ranks: {found.text}")
        err.culprits = found.culprits
        return err

    def timed_out(self) -> ActorTimeout | None:
        """An `ActorTimeout` for the first actor waiting longer than the timeout (lock held)."""
        run = self.run
        now, limit = time.perf_counter(), run.rt.timeout
        for a in run.actors.values():
            if now - a.since < limit or a.finished():
                continue
            what = f"actor {a.name!r} ({a.spec.kind}, stage {a.spec.stage}) on rank {self.rank}"
            if a.busy:  # a timeout inside its function: a hung collective, an endless loop
                return ActorTimeout(
                    f"{what} has been inside its function for {now - a.since:.3g} s "
                    f"(micro-batch {a.fired}); it fired {a.fired} of {a.times} times (timeout "
                    f"{limit:g} s, SBPFLOW_TIMEOUT)")
            if run.mail.gated(a):
                return ActorTimeout(
                    f"{what} waited {now - a.since:.3g} s for ranks "
                    f"{sorted(run.mail.unstarted)} to start {run.label()} (every rank of a "
                    f"plan calls run() as often; timeout {limit:g} s, SBPFLOW_TIMEOUT)")
            if a.can_fire():
                continue
            return ActorTimeout(
                f"{what} waited {now - a.since:.3g} s for {a.blocker()}; it fired {a.fired} of "
                f"{a.times} times (timeout {limit:g} s, SBPFLOW_TIMEOUT)")
        return None

    # -- the end ------------------------------------------------------------------------------
    def stop(self, threads: list[Job]) -> None:
        """Wake every thread, wait for them (a bounded time after a failure) and name on the
        exception the threads left inside an actor's function; they are remembered, so the
        next run on this communicator refuses to start while they live."""
        run = self.run
        with run.lock:
            run.over = True
            for c in run.conds.values():
                c.notify_all()
        run.mail.deactivate()
        grace = _STOP_GRACE if self.failure is not None else run.rt.timeout
        deadline = time.monotonic() + grace
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        stuck = [t for t in threads if t.is_alive()]
        if not stuck:
            return
        with run.lock:
            busy = [a.name for a in run.actors.values() if a.busy]
        with run.rt.shared.lock:
            run.rt.shared.left_behind.extend((t, f"actor(s) {busy}") for t in stuck)
        if self.failure is not None and hasattr(self.failure, "add_note"):
            self.failure.add_note(f"rank {self.rank}: threads {[t.name for t in stuck]} still "
                                  f"inside actor(s) {busy} {grace:g} s after the failure, "
                                  f"left behind")
