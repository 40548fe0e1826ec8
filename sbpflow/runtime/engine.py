"""The actor runtime of one rank: `Runtime(plan).run(micro_batches)` runs the rank's actors.

No central loop orders the work: each queue thread (compute, comm, data, ...) fires the first
of its actors that the firing rule allows, publishes its outputs (``req`` to each consumer) and
acks its inputs; messages to other ranks go over the Communicator's message channel, read by
an inbox thread. A failing actor aborts every rank of the plan; an actor that cannot fire for
``SBPFLOW_TIMEOUT`` s raises `ActorTimeout`. Every firing is a timeline event. What is not
done yet: plans cannot change between runs, and the torch backend's messages go through the
c10d store (pickled; fine for control messages, slow for large tensors). See
docs/runtime.md, 'Actors and registers'.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ..comm.base import Communicator
from ..comm.current import current, set_current
from ..comm.threads import default_timeout
from ..errors import ActorAborted, ActorTimeout, CommError, PlanError
from .actors import Actor
from .specs import Plan

__all__ = ["Runtime"]

_POLL = 0.05  # s between the supervisor's timeout checks and the inbox's liveness checks
_STOP_GRACE = 0.75  # s a failed run waits for its threads (an actor may be inside its fn);
# below the 1 s `launch` gives a failed world, so a rank reports what its runtime says


class Runtime:
    """Runs this rank's part of ``plan`` (every rank of the plan makes its own `Runtime` and
    calls `run` the same number of times). ``comm``: default the calling rank's. ``timeout``:
    seconds an actor may wait (default ``SBPFLOW_TIMEOUT``)."""

    def __init__(self, plan: Plan, comm: Communicator | None = None,
                 timeout: float | None = None) -> None:
        self.plan, self.comm = plan, comm or current()
        self.rank = self.comm.rank
        outside = [r for r in plan.actors if not 0 <= r < self.comm.world_size]
        if outside:
            raise PlanError(f"plan {plan.name!r} has actors on ranks {outside}, outside the "
                            f"world of {self.comm.world_size}")
        self.timeout = default_timeout() if timeout is None else float(timeout)
        self.channel = f"sbpflow.runtime/{plan.name}"
        self.runs = 0  # runs started; messages carry it, so a late one is never misread
        self.early: list[tuple[int, tuple]] = []  # messages of a later run than the current
        self._step: _Step | None = None

    def run(self, micro_batches: int) -> dict[str, list]:
        """Run every actor of this rank its number of times (default ``micro_batches``).

        Returns the values of the registers no actor reads, in order, keyed by actor (by
        ``actor.register`` when it has several registers). Raises an actor's own exception
        (noted with its rank and actor), `ActorAborted` when an actor of another rank failed,
        or `ActorTimeout`.
        """
        if not isinstance(micro_batches, int) or micro_batches < 1:
            raise PlanError(f"micro_batches must be an int >= 1, got {micro_batches!r}")
        self.plan.check_rates(micro_batches)
        self.runs += 1
        self._step = _Step(self, micro_batches)
        return self._step.execute()

    def timeline(self) -> list[dict]:
        """This rank's firings of the last run: ``{"rank", "actor", "kind", "stage",
        "micro_batch", "start", "end"}`` (``time.perf_counter`` seconds)."""
        return list(self._step.events) if self._step else []

    def counters(self) -> dict[str, int]:
        """How many times each actor of this rank has fired in the current (or last) run."""
        return {a.name: a.fired for a in self._step.actors.values()} if self._step else {}


class _Step:
    """One run on one rank: the actors' state, the threads, the failure."""

    def __init__(self, rt: Runtime, micro_batches: int) -> None:
        self.rt, self.comm, self.rank, self.run_id = rt, rt.comm, rt.rank, rt.runs
        self.lock = threading.Lock()
        now = time.perf_counter()
        specs = rt.plan.actors.get(self.rank, [])
        self.actors = {s.name: Actor(s, self.rank, rt.plan, micro_batches, now) for s in specs}
        self.queues: dict[str, list[Actor]] = {}
        for a in self.actors.values():
            self.queues.setdefault(a.spec.queue, []).append(a)
        self.conds = {q: threading.Condition(self.lock) for q in self.queues}
        self.main = threading.Condition(self.lock)
        self.left = sum(a.times for a in self.actors.values())  # firings + slots in flight
        self.over = False
        self.failure: BaseException | None = None
        self.events: list[dict] = []
        self.results: dict[str, list] = {}
        self.peers = [r for r in rt.plan.ranks if r != self.rank]

    # -- the run ------------------------------------------------------------------------------
    def execute(self) -> dict[str, list]:
        early, self.rt.early = self.rt.early, []
        self._dispatch(early)
        threads = [threading.Thread(target=self._queue_loop, args=(q,), daemon=True,
                                    name=f"sbpflow-rank{self.rank}-{q}") for q in self.queues]
        if self.peers:
            threads.append(threading.Thread(target=self._inbox_loop, daemon=True,
                                            name=f"sbpflow-rank{self.rank}-inbox"))
        for t in threads:
            t.start()
        try:
            self._supervise()
        except BaseException as exc:  # e.g. KeyboardInterrupt: stop every rank
            self._fail(exc, None)
            raise
        finally:
            self._stop(threads)
        if self.failure is not None:
            raise self.failure
        return self.results

    def _supervise(self) -> None:
        """Wait until every actor finished (or the run failed), checking for timeouts."""
        exc = None
        with self.lock:
            while not self.over and self.left:
                self.main.wait(_POLL)
                exc = None if self.over else self._timed_out()
                if exc is not None:
                    break
            self.over = True
        if exc is not None:
            self._fail(exc, None)

    def _stop(self, threads: list[threading.Thread]) -> None:
        """Wake every thread, wait for them (a bounded time after a failure) and name on the
        exception the threads left inside an actor's function."""
        with self.lock:
            self.over = True
            for c in self.conds.values():
                c.notify_all()
        if self.peers:
            self._post(self.rank, ("wake", self.run_id))  # the inbox returns at once
        grace = _STOP_GRACE if self.failure is not None else self.rt.timeout
        deadline = time.monotonic() + grace
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in threads if t.is_alive()]
        if stuck and self.failure is not None and hasattr(self.failure, "add_note"):
            busy = [a.name for a in self.actors.values() if a.busy]
            self.failure.add_note(f"rank {self.rank}: threads {stuck} still inside actor(s) "
                                  f"{busy} {grace:g} s after the failure, left behind")

    # -- threads ------------------------------------------------------------------------------
    def _queue_loop(self, queue: str) -> None:
        """Fire this queue's actors, first ready first, until all fired their times."""
        set_current(self.comm)  # actors' collectives use this rank's communicator
        actors, cond = self.queues[queue], self.conds[queue]
        try:
            with self.lock:
                while not self.over:
                    a = next((a for a in actors if a.can_fire()), None)
                    if a is not None:
                        self._fire(a)
                    elif all(a.fired >= a.times for a in actors):
                        return
                    else:
                        cond.wait()
        except BaseException as exc:  # noqa: BLE001 - a runtime bug: stop the run, say where
            self._fail(exc, None)
        finally:
            set_current(None)

    def _inbox_loop(self) -> None:
        """Read this rank's channel and hand the messages to the actors."""
        set_current(self.comm)
        try:
            while not self.over:
                self._dispatch(self.comm.inbox(self.rt.channel, _POLL))
        except BaseException as exc:  # noqa: BLE001 - e.g. CommAborted: another rank died
            self._fail(exc, None)
        finally:
            set_current(None)

    # -- firing -------------------------------------------------------------------------------
    def _fire(self, a: Actor) -> None:
        """Fire ``a`` (called with the lock held; returns with it held, released meanwhile)."""
        index = a.fired
        # a value read ``repeat`` times stays at its queue's head until its last firing
        taken = [q.popleft() if (index + 1) % k == 0 else q[0] + (False,)
                 for q, k in zip(a.inputs, a.repeats)]
        emit = (index + 1) % a.every == 0
        slots = [reg.free.popleft() for reg in a.outputs] if emit else []
        a.busy = True
        self.lock.release()
        remote: list[tuple[int, tuple]] = []
        try:
            start = time.perf_counter()
            try:
                out = a.fn(index, *[t[2] for t in taken])
                values = _split(a, out) if emit else ()
            except BaseException as exc:  # noqa: BLE001 - the actor's failure aborts the run
                self._fail(exc, a, index)
                return
            end = time.perf_counter()
            with self.lock:
                a.busy = False
                remote = self._publish(a, index, taken, slots, values, start, end)
        finally:
            for dst, msg in remote:
                self._post(dst, msg)
            self.lock.acquire()

    def _publish(self, a: Actor, index: int, taken: list, slots: list, values: tuple,
                 start: float, end: float) -> list[tuple[int, tuple]]:
        """Count the firing, send ``req`` for each output slot, then ``ack`` each input: local
        messages at once, the others returned to post (lock held)."""
        a.fired += 1
        a.since = end
        self.left -= 1
        spec = a.spec
        self.events.append({"rank": self.rank, "actor": a.name, "kind": spec.kind,
                            "stage": spec.stage, "micro_batch": index, "start": start,
                            "end": end})
        remote = []
        for reg, slot, value in zip(a.outputs, slots, values):
            if not reg.consumers:  # a sink: the caller gets the value
                key = a.name if len(a.outputs) == 1 else f"{a.name}.{reg.name}"
                self.results.setdefault(key, []).append(value)
                reg.free.append(slot)
                continue
            reg.publish(slot, index // a.every)
            self.left += 1
            for c in reg.consumers:
                msg = ("req", self.run_id, c.actor, c.index, slot, index // a.every, value)
                if c.rank == self.rank:
                    self._on_req(msg)
                else:
                    remote.append((c.rank, msg))
        for i, ((rank, producer, _, reg), entry) in enumerate(zip(a.sources, taken)):
            if len(entry) > 3:  # read again by the next firing: no ack yet
                continue
            msg = ("ack", self.run_id, producer, reg, entry[0], (self.rank, a.name, i))
            if rank == self.rank:
                self._on_ack(msg)
            else:
                remote.append((rank, msg))
        if self.left == 0:
            self.main.notify()
        return remote

    # -- messages -----------------------------------------------------------------------------
    def _post(self, dst: int, msg: tuple) -> None:
        try:
            self.comm.post(dst, self.rt.channel, msg)
        except CommError as exc:  # the world is aborted: stop too (no-op when already over)
            if msg[0] != "abort":
                self._fail(exc, None)

    def _dispatch(self, msgs: list[tuple[int, tuple]]) -> None:
        if not msgs:
            return
        aborts = []
        with self.lock:
            for src, msg in msgs:
                if msg[1] > self.run_id:
                    self.rt.early.append((src, msg))
                elif msg[1] < self.run_id or msg[0] == "wake":
                    continue
                elif msg[0] == "req":
                    self._on_req(msg)
                elif msg[0] == "ack":
                    self._on_ack(msg)
                elif msg[0] == "abort":
                    aborts.append(msg[2])
            if self.left == 0:
                self.main.notify()
        for text in aborts:
            self._fail(ActorAborted(f"{text}; the runtime of rank {self.rank} stopped"), None,
                       broadcast=False)

    def _on_req(self, msg: tuple) -> None:
        _, _, actor, i, slot, index, value = msg
        a = self.actors[actor]
        if index != a.received[i]:  # a plan or runtime bug, never a user's
            raise PlanError(f"actor {actor!r} on rank {self.rank}: input {i} got value {index} "
                            f"out of order (expected {a.received[i]})")
        a.received[i] += 1
        a.inputs[i].append((slot, index, value))
        a.since = time.perf_counter()
        self.conds[a.spec.queue].notify()

    def _on_ack(self, msg: tuple) -> None:
        _, _, actor, reg, slot, consumer = msg
        a = self.actors[actor]
        if a.outputs[reg].ack(slot, consumer):
            self.left -= 1
            a.since = time.perf_counter()
            self.conds[a.spec.queue].notify()

    # -- failure ------------------------------------------------------------------------------
    def _fail(self, exc: BaseException, actor: Actor | None, index: int | None = None,
              broadcast: bool = True) -> None:
        """Record the run's first failure, wake every thread, tell the other ranks."""
        where = f"rank {self.rank}"
        if actor is not None:
            where = (f"actor {actor.name!r} ({actor.spec.kind}, stage {actor.spec.stage}, "
                     f"micro-batch {index}) on rank {self.rank}")
            if hasattr(exc, "add_note"):
                exc.add_note(f"raised by {where} (sbpflow runtime)")
        with self.lock:
            if actor is not None:
                actor.busy = False
            first = self.failure is None
            if first:
                self.failure, self.over = exc, True
                for c in self.conds.values():
                    c.notify_all()
                self.main.notify_all()
        if first and broadcast:
            text = f"{where} failed with {type(exc).__name__}: {exc}"
            if isinstance(exc, ActorAborted):
                text = str(exc)
            for r in self.peers:
                self._post(r, ("abort", self.run_id, text))
            if self.peers:
                self._post(self.rank, ("wake", self.run_id))

    def _timed_out(self) -> ActorTimeout | None:
        """An `ActorTimeout` for the first actor waiting longer than the timeout (lock held)."""
        now, limit = time.perf_counter(), self.rt.timeout
        for a in self.actors.values():
            if now - a.since < limit or a.busy or a.can_fire() or a.finished():
                continue
            return ActorTimeout(
                f"actor {a.name!r} ({a.spec.kind}, stage {a.spec.stage}) on rank {self.rank} "
                f"waited {now - a.since:.3g} s for {a.blocker()}; it fired {a.fired} of "
                f"{a.times} times (timeout {limit:g} s, SBPFLOW_TIMEOUT)")
        return None


def _split(a: Actor, out: Any) -> tuple:
    """The value of each output register from what ``a.fn`` returned."""
    if len(a.outputs) == 1:
        return (out,)
    if not isinstance(out, (tuple, list)) or len(out) != len(a.outputs):
        raise PlanError(f"actor {a.name!r} has {len(a.outputs)} output registers "
                        f"{[r.name for r in a.outputs]} but its fn returned {type(out).__name__}"
                        f" (return a tuple, one value a register)")
    return tuple(out)
