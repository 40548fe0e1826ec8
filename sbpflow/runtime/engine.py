"""The actor runtime of one rank: `Runtime(plan).run(micro_batches)` runs the rank's actors.

No central loop orders the work: each queue thread (compute, comm, data, ...) fires the first
of its actors that the firing rule allows, publishes its outputs (``req`` to each consumer) and
acks its inputs; messages to other ranks go over the Communicator's message channel, read by
one reader thread a channel kept from run to run (`inbox`). A failing actor aborts every rank
of the plan; an actor that cannot fire, or stays inside its function, for ``SBPFLOW_TIMEOUT``
s raises `ActorTimeout`; a run refuses to start while a failed run's thread is left inside an
actor (its collective would pair with the new run's). A rank of a plan that allows it
(`Plan.runs_inline`: one queue, no other rank's actors) runs its actors on the calling thread
when its collectives can be interrupted (threads backend).
Every firing is a timeline event. The torch backend's messages travel as typed frames over
authenticated sockets between the ranks (the c10d store as a fallback; `sbpflow.comm.wire`). See docs/runtime.md, 'Actors and registers'.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from functools import partial
from typing import Any

import torch

from .. import memory
from ..comm.base import Communicator
from ..comm.channels import copy_tensors, tensor_bytes
from ..comm.current import current, rank_local, set_current
from ..comm.threads import ThreadCommunicator, waits_alongside
from ..errors import ActorAborted, ActorTimeout, CommError, PlanError
from .actors import Actor
from .inbox import Router, ensure_reader, failure_notice, route
from .workers import Job, Workers
from .specs import Plan

__all__ = ["Runtime"]

# after a firing that woke another queue's thread: that thread (a transfer's, mostly) takes the
# core at once instead of waiting for this one's next kernels; on 2 shared cores the send's
# start after a forward went from 0.39 to 0.28 ms, 1F1B's step 4-5% down (docs/runtime.md)
_yield = getattr(os, "sched_yield", lambda: time.sleep(0))
_POLL = 0.05  # s between the supervisor's timeout checks and the inbox's liveness checks
_STOP_GRACE = 0.75  # s a failed run waits for its threads (an actor may be inside its fn);
# below the 1 s `launch` gives a failed world, so a rank reports what its runtime says
_GATED = ("collective", "send", "recv")  # kinds whose fn may talk to the communicator directly:
# after a failed run they fire only once every rank of the plan started the run with no thread
# left behind, so they never pair with that run's abandoned collective


class _CommState:
    """What the runtimes of one communicator share: the run counter and the early messages of
    each channel (a fresh `Runtime` on the same plan name goes on counting, so it never reads
    a previous one's leftover messages as its own) and the threads failed runs left behind."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.runs: dict[str, int] = {}
        self.early: dict[str, list[tuple[int, tuple]]] = {}
        self.left_behind: list[tuple[Job, str]] = []  # (thread, its actors)
        # a run failed on this communicator (an abort reaches every rank of the plan, so then
        # every rank's flag is set): from then on transfers and collectives wait for the start
        # handshake (no left-behind thread anywhere); until then they need not wait for it
        self.failed = False
        self.failures = 0  # failed runs (see `Runtime.failures`)
        # each channel's reader hands messages to the channel's active run (`inbox.Router`);
        # ``early`` is read and written under ``route`` only
        self.route = threading.RLock()
        self.routers: dict[str, Router] = {}

    def router(self, channel: str) -> Router:
        with self.route:
            r = self.routers.get(channel)
            if r is None:
                r = self.routers[channel] = Router()
            return r

    def next_run(self, channel: str) -> int:
        with self.lock:
            self.runs[channel] = self.runs.get(channel, 0) + 1
            return self.runs[channel]

    def alive(self) -> list[str]:
        """The left-behind threads still running, as "name (inside actors)"."""
        with self.lock:
            self.left_behind = [(t, a) for t, a in self.left_behind if t.is_alive()]
            return [f"{t.name} (inside {a})" for t, a in self.left_behind]


_STATES: "weakref.WeakKeyDictionary[Communicator, _CommState]" = weakref.WeakKeyDictionary()
_STATES_LOCK = threading.Lock()


# threads backend: each world's (rank, channel) -> (router, comm state, communicator), so that
# a req or ack is handed to the receiving run by the sender's thread (`_PlanRun._post`); read and
# written under _STATES_LOCK
_DIRECT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _direct(comm: Communicator) -> bool:
    """Whether reqs and acks go to the receiving run directly (the threads backend)."""
    return isinstance(comm, ThreadCommunicator)


def _register(rt: "Runtime") -> None:
    """Let the senders of the threads backend hand ``rt``'s channel its reqs and acks. Those
    they posted before (its runtime did not exist yet) are taken from the channel now, under
    the same lock as the senders' choice, so they keep their order before the direct ones."""
    with _STATES_LOCK:
        mine = _DIRECT.setdefault(rt.comm.world, {})
        if (rt.rank, rt.channel) in mine:
            return
        # (the communicator weakly: it holds the world, this map's key)
        mine[(rt.rank, rt.channel)] = (rt.router, rt.shared, weakref.ref(rt.comm))
        try:
            pending = rt.comm.inbox(rt.channel, 0.0)
        except CommError:  # the world aborted: the run's reader reports it
            return
        if pending:
            with rt.shared.route:
                route(rt.router, rt.shared.early.setdefault(rt.channel, []), pending)


def _state(comm: Communicator) -> _CommState:
    with _STATES_LOCK:
        st = _STATES.get(comm)
        if st is None:
            st = _STATES[comm] = _CommState()
        return st


class Runtime:
    """Runs this rank's part of ``plan`` (every rank of the plan makes its own `Runtime` and
    calls `run` the same number of times). ``comm``: default the calling rank's. ``timeout``:
    seconds an actor may wait (default the communicator's, `Communicator.wait_timeout`:
    ``sf.launch(..., timeout=)`` or ``SBPFLOW_TIMEOUT``)."""

    def __init__(self, plan: Plan, comm: Communicator | None = None,
                 timeout: float | None = None) -> None:
        self.plan, self.comm = plan, comm or current()
        self.rank = self.comm.rank
        outside = [r for r in plan.actors if not 0 <= r < self.comm.world_size]
        if outside:
            raise PlanError(f"plan {plan.name!r} has actors on ranks {outside}, outside the "
                            f"world of {self.comm.world_size}")
        self.timeout = self.comm.wait_timeout() if timeout is None else float(timeout)
        self.channel = f"sbpflow.runtime/{plan.name}"
        self.shared = _state(self.comm)  # run ids and early messages per (comm, channel)
        self.router = self.shared.router(self.channel)
        with self.shared.route:
            self.router.runtimes.add(self)  # the channel's reader lives while a runtime does
        if _direct(self.comm):
            _register(self)
        self.runs = 0  # the id of the last run started: messages carry it, so a late one is
        # never misread (counted per communicator and channel, not per Runtime)
        self._run: _PlanRun | None = None
        self.workers = Workers()  # the queues' threads, kept from run to run
        # whether this rank runs its actors on the calling thread (`Plan.runs_inline`), and
        # the plan that answer is for
        self.inline, self._inline_of = False, None

    def run(self, micro_batches: int, plan: Plan | None = None) -> dict[str, list]:
        """Run every actor of this rank its number of times (default ``micro_batches``).
        ``plan``: run this plan from now on instead (a schedule whose actors change from run
        to run, as Cyclic Data Parallelism's windows); it must keep the plan's name, so its
        messages go on counting runs on the same channel.

        Returns the values of the registers no actor reads, in order, keyed by actor (by
        ``actor.register`` when it has several registers). Raises an actor's own exception
        (noted with its rank and actor), `ActorAborted` when an actor of another rank failed,
        or `ActorTimeout`. Raises `CommError` (and aborts the other ranks' run) while a
        thread a failed run left behind is still inside an actor on this rank's communicator:
        its collective would pair with this run's.
        """
        if not isinstance(micro_batches, int) or micro_batches < 1:
            raise PlanError(f"micro_batches must be an int >= 1, got {micro_batches!r}")
        if plan is not None:
            if plan.name != self.plan.name:
                raise PlanError(f"plan {plan.name!r} given to the runtime of plan "
                                f"{self.plan.name!r}: a new plan keeps the name")
            self.plan = plan
        self.plan.check_rates(micro_batches)
        if self.plan is not self._inline_of:  # (a plan given to run may differ)
            # (inline only where a failure elsewhere can interrupt a waiting collective: a
            # gloo one cannot be, and only a thread of its own lets the run stop in 2 s)
            self._inline_of = self.plan
            self.inline = self.comm.interruptible and self.plan.runs_inline(self.rank)
        self.runs = self.shared.next_run(self.channel)
        self._run = _PlanRun(self, micro_batches)
        try:
            return self._run.execute_inline() if self.inline else self._run.execute()
        except BaseException:
            with self.shared.lock:
                self.shared.failures += 1
            raise

    @property
    def failures(self) -> int:
        """How many runs failed on this communicator (a failure aborts every rank of the plan,
        so the ranks count alike): a plan whose actors name their collective streams after it
        starts new series after a failure, whose aborted collectives left each rank's call
        counts apart."""
        return self.shared.failures

    def close(self) -> None:
        """End the threads the runtime keeps between runs (also done when it is garbage)."""
        self.workers.close()
        with self.shared.route:
            self.router.runtimes.discard(self)

    def timeline(self) -> list[dict]:
        """This rank's firings of the last run: ``{"rank", "actor", "kind", "stage",
        "micro_batch", "start", "end"}`` (``time.perf_counter`` seconds)."""
        return list(self._run.events) if self._run else []

    def counters(self) -> dict[str, int]:
        """How many times each actor of this rank has fired in the current (or last) run."""
        return {a.name: a.fired for a in self._run.actors.values()} if self._run else {}


class _PlanRun:
    """One run on one rank: the actors' state, the threads, the failure."""

    def __init__(self, rt: Runtime, micro_batches: int) -> None:
        self.rt, self.comm, self.rank, self.run_id = rt, rt.comm, rt.rank, rt.runs
        self.lock = threading.Lock()
        now = self.began = time.perf_counter()
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
        # the ranks whose "start" has not arrived: until then gated actors (_GATED) wait, once a
        # run has failed on this communicator (`_CommState.failed`)
        self.unstarted = set(self.peers)
        self.careful = rt.shared.failed
        self.posted_start = False  # this run's start went to the peers (see `_stale_failure`)
        self.woke: set = set()
        self.trackers = memory.active_trackers()  # the caller's `sf.memory.track()` blocks
        self.threads: dict[str, threading.Thread] = {}  # queue -> the thread running it

    def doing(self) -> tuple[str, float, list, list[int]]:
        """What this run is doing, for the rank's `Activity` (read by another thread, without
        the lock: attribute reads and copies, racy by a firing at most): its label, its start,
        for each actor inside its function ``(thread, actor text, micro-batch, since)``, and
        the other ranks whose messages its waiting actors wait for (a req for an input, an
        ack of an output)."""
        busy, peers = [], set()
        for a in self.actors.values():
            if a.busy:
                t = self.threads.get(a.spec.queue)
                if t is not None:
                    busy.append((t, f"actor {a.name!r} ({a.spec.kind}, stage {a.spec.stage})",
                                 a.fired, a.since))
                continue
            if a.fired < a.times:
                peers.update(src[0] for q, src in zip(a.inputs, a.sources) if not q)
            for reg in a.outputs:
                for left in list(reg.waiting.values()):
                    peers.update(c[0] for c in list(left))
        peers.discard(self.rank)
        return self.label(), self.began, busy, sorted(peers)

    def label(self) -> str:
        """``run 2 of plan 'p'``: this run, in a timeout's words (`Activity`)."""
        return f"run {self.run_id} of plan {self.rt.plan.name!r}"

    def gated(self, a: Actor) -> bool:
        return self.careful and bool(self.unstarted) and a.spec.kind in _GATED

    # -- the run ------------------------------------------------------------------------------
    def execute(self) -> dict[str, list]:
        self._refuse_if_stale()
        workers = self.rt.workers
        activity = self.comm.activity
        activity.started(self)  # (timeout reports read what its actors do: `doing`)
        threads = [workers.submit(f"sbpflow-rank{self.rank}-{q}", partial(self._queue_loop, q))
                   for q in self.queues]
        try:
            self._start()  # once the queues run: a post may be a store round trip
            self._supervise()
        except BaseException as exc:  # e.g. KeyboardInterrupt: stop every rank
            self._fail(exc, None)
            raise
        finally:
            self._stop(threads)
            activity.ended(self)
        if self.failure is not None:
            workers.close()  # the next run starts on fresh threads
            raise self.failure
        return self.results

    def execute_inline(self) -> dict[str, list]:
        """The run on the calling thread (`Plan.runs_inline`): the one queue's loop, with the
        supervisor's timeout checks between firings; aborts come in on the channel's reader
        thread, whose interrupt ends a collective an actor waits in. Saves and restores what
        a queue thread sets (the communicator, the grad mode it starts with)."""
        self._refuse_if_stale()
        local = rank_local()
        previous = local.comm
        exc = None
        activity = self.comm.activity
        self.threads = dict.fromkeys(self.queues, threading.current_thread())
        activity.started(self)
        try:
            self._start()
            set_current(self.comm)
            waits_alongside(True)  # as on a queue thread: the reader waits beside it
            with memory.attach(self.trackers), torch.enable_grad(), self.lock:
                exc = self._inline_loop([a for q in self.queues.values() for a in q])
        except BaseException as err:  # e.g. KeyboardInterrupt: stop every rank
            self._fail(err, None)
            raise
        finally:
            waits_alongside(False)
            local.comm = previous
            with self.rt.shared.route:  # from now on the reader keeps or drops its messages
                if self.rt.router.active is self:
                    self.rt.router.active = None
            activity.ended(self)
        if exc is not None:
            self._fail(self._explained(exc), None)
        if self.failure is not None:
            raise self.failure
        return self.results

    def _inline_loop(self, actors: list[Actor]) -> ActorTimeout | None:
        """Fire the actors, first ready first, until all fired (or the run failed); waiting,
        check for timeouts as `_supervise` does. Returns the timeout (lock held)."""
        cond = self.conds[actors[0].spec.queue] if actors else self.main
        try:
            while not self.over:
                a = next((a for a in actors if a.can_fire() and not self.gated(a)), None)
                if a is not None:
                    self._fire(a)
                elif not self.left:
                    return None
                else:  # a gated actor waits for the starts, or a plan bug: time it out
                    cond.wait(_POLL)
                    exc = None if self.over else self._timed_out()
                    if exc is not None:
                        return exc
            return None
        finally:
            self.over = True

    def _refuse_if_stale(self) -> None:
        """Refuse the run (`CommError`, and tell the other ranks, whose run aborts) while a
        thread a failed run left behind is inside an actor: a collective of that thread would
        pair with this run's and give every rank wrong values."""
        stale = self.rt.shared.alive()
        if stale:
            problem = (f"rank {self.rank} cannot start run {self.run_id} of plan "
                       f"{self.rt.plan.name!r}: threads {stale} of a failed run are still "
                       f"running (their collectives would pair with this run's); wait until "
                       f"they return (at most the communication timeout) and run again")
            for r in self.peers:
                self._post(r, ("start", self.run_id, problem))
            raise CommError(problem)

    def _start(self) -> None:
        """Make this run the channel's active one (its reader hands it the messages, those
        that came early first) and, after a failed run (`gated`), tell the other ranks it
        started. Until a run fails no rank waits for a start: posting it would cost every run
        a message to each peer (a store round trip each on the torch backend)."""
        shared, router = self.rt.shared, self.rt.router
        if self.peers:
            ensure_reader(self.comm, self.rt.channel, router, shared.route,
                          lambda: shared.early.setdefault(self.rt.channel, []),
                          f"sbpflow-rank{self.rank}-inbox")
        with shared.route:
            router.active, router.last = self, self.run_id
            # (weakly: the communicator's shared state outlives the run, and a strong reference
            # kept the run, its runtime, and so the communicator itself and all that a graph
            # holds, its data loader's processes too, alive as long as the process)
            router.on_stale_failure = weakref.WeakMethod(self._stale_failure)
            if self.careful:
                self._post_start()
            self.dispatch(shared.early.pop(self.rt.channel, []))

    def _post_start(self) -> None:
        self.posted_start = True
        for r in self.peers:
            self._post(r, ("start", self.run_id, None))

    def _stale_failure(self, run: int) -> None:
        """A rank says an earlier run (``run``) failed, after this rank's part of it ended: the
        failure's ranks wait for every start from now on, this run's included."""
        self.rt.shared.failed = True
        if not self.posted_start:
            self._post_start()

    def fail(self, exc: BaseException) -> None:
        """Fail the run (its channel's reader could not read)."""
        self._fail(exc, None)

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
            self._fail(self._explained(exc), None)

    def _stop(self, threads: list[Job]) -> None:
        """Wake every thread, wait for them (a bounded time after a failure) and name on the
        exception the threads left inside an actor's function; they are remembered, so the
        next run on this communicator refuses to start while they live."""
        with self.lock:
            self.over = True
            for c in self.conds.values():
                c.notify_all()
        with self.rt.shared.route:  # from now on the reader keeps or drops this run's messages
            if self.rt.router.active is self:
                self.rt.router.active = None
        grace = _STOP_GRACE if self.failure is not None else self.rt.timeout
        deadline = time.monotonic() + grace
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        stuck = [t for t in threads if t.is_alive()]
        if not stuck:
            return
        with self.lock:
            busy = [a.name for a in self.actors.values() if a.busy]
        with self.rt.shared.lock:
            self.rt.shared.left_behind.extend((t, f"actor(s) {busy}") for t in stuck)
        if self.failure is not None and hasattr(self.failure, "add_note"):
            self.failure.add_note(f"rank {self.rank}: threads {[t.name for t in stuck]} still "
                                  f"inside actor(s) {busy} {grace:g} s after the failure, "
                                  f"left behind")

    # -- threads ------------------------------------------------------------------------------
    def _queue_loop(self, queue: str) -> None:
        """Fire this queue's actors, first ready first, until all fired their times."""
        set_current(self.comm)  # actors' collectives use this rank's communicator
        waits_alongside(True)  # a rank's queue threads may wait at once (a recv, a compute)
        self.threads[queue] = threading.current_thread()
        actors, cond = self.queues[queue], self.conds[queue]
        try:
            # tensors the actors save for backward count in the caller's `sf.memory.track()`
            with memory.attach(self.trackers), self.lock:
                while not self.over:
                    a = next((a for a in actors if a.can_fire() and not self.gated(a)), None)
                    if a is not None:
                        self._fire(a)
                    elif all(a.fired >= a.times for a in actors):
                        return
                    else:
                        cond.wait()
        except BaseException as exc:  # noqa: BLE001 - a runtime bug: stop the run, say where
            self._fail(exc, None)
        finally:
            waits_alongside(False)
            set_current(None)

    # -- firing -------------------------------------------------------------------------------
    def _fire(self, a: Actor) -> None:
        """Fire ``a`` (called with the lock held; returns with it held, released meanwhile)."""
        index = a.fired
        # a value read ``repeat`` times stays at its queue's head until its last firing
        taken = [q.popleft() if (index + 1) % k == 0 else q[0] + (False,)
                 for q, k in zip(a.inputs, a.repeats)]
        emit = a.emits_now()  # index == a.fired until _publish counts it
        slots = [reg.free.popleft() for reg in a.outputs] if emit else []
        a.busy, a.since = True, time.perf_counter()  # since: for a timeout inside fn
        self.lock.release()
        remote: list[tuple[int, tuple]] = []
        other = False
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
                self.woke = set()
                remote = self._publish(a, index, taken, slots, values, start, end)
                other = bool(self.woke - {a.spec.queue})
        finally:
            try:
                for dst, msg in remote:
                    self._post(dst, msg)
            finally:  # whatever a post raised, return with the lock held (the caller's with)
                if other:  # hand the core to the thread it woke (a send's, a backward's)
                    _yield()  # now, not after this thread's next kernels (`_yield`)
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
            if len(entry) > 3:  # read again by the next firing: no ack yet, but the producer
                if rank == self.rank:  # waiting for it is not idle (GPipe's flush)
                    self.actors[producer].since = end
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
        """Post ``msg``; never raises (it runs while stopping): a failed post fails the run.
        On the threads backend a ``req`` or ``ack`` is handed to the receiving rank's run by
        this thread (`_deliver`): no wake-up of the receiver's reader thread a message."""
        try:
            if msg[0] in ("req", "ack") and _direct(self.comm):
                with _STATES_LOCK:  # against `_register`: no post after its look at the channel
                    target = _DIRECT.get(self.comm.world, {}).get((dst, self.rt.channel))
                    if target is None:  # the receiver's runtime does not exist yet
                        self.comm.post(dst, self.rt.channel, msg)
                        return
                self._deliver(target, msg)
                return
            self.comm.post(dst, self.rt.channel, msg)
        except Exception as exc:  # noqa: BLE001 - e.g. the world aborted, the store is gone
            if msg[0] == "abort":  # already stopping: the first failure stands
                return
            if not isinstance(exc, CommError):
                err = CommError(f"rank {self.rank}: posting a {msg[0]!r} message to rank {dst} "
                                f"on channel {self.rt.channel!r} failed with "
                                f"{type(exc).__name__}: {exc}")
                err.__cause__, exc = exc, err
            self._fail(exc, None)

    def _deliver(self, target: tuple, msg: tuple) -> None:
        """Hand ``msg`` to the run active on the receiver's channel, or keep it for a later
        run, as its reader would (its route lock taken, no lock of this rank held: the
        receiver's dispatch of a req or ack posts nothing). Counted and copied as a post."""
        router, shared, comm_ref = target
        size = tensor_bytes(msg)
        self.comm._count("message", size, 0)
        msg = copy_tensors(msg)
        with shared.route:
            route(router, shared.early.setdefault(self.rt.channel, []), [(self.rank, msg)])
        comm = comm_ref()
        if comm is not None:
            comm._count("message", 0, size)

    def dispatch(self, msgs: list[tuple[int, tuple]]) -> None:
        """Hand the messages read from the channel to the actors (the route lock held)."""
        if not msgs:
            return
        aborts, stale = [], False
        with self.lock:
            for src, msg in msgs:
                if msg[1] > self.run_id:
                    self.rt.shared.early.setdefault(self.rt.channel, []).append((src, msg))
                elif msg[1] < self.run_id:
                    stale = stale or failure_notice(msg)
                    continue
                elif msg[0] == "req":
                    self._on_req(msg)
                elif msg[0] == "ack":
                    self._on_ack(msg)
                elif msg[0] == "abort":  # (text, the culprits the failure names)
                    aborts.append((msg[2], msg[3] if len(msg) > 3 else ()))
                elif msg[0] == "start":
                    if msg[2] is not None:
                        aborts.append((msg[2], ()))
                    self._on_start(src)
            if self.left == 0:
                self.main.notify()
        if stale:
            self._stale_failure(self.run_id)
        for text, culprits in aborts:
            err = ActorAborted(f"{text}; the runtime of rank {self.rank} stopped")
            err.culprits = tuple(culprits)  # (a failure that named them names them here too)
            self._fail(err, None, broadcast=False)

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
        self.woke.add(a.spec.queue)

    def _on_start(self, src: int) -> None:
        """Rank ``src`` started this run: once all did, the gated actors may fire (their
        wait for a timeout starts now)."""
        if src not in self.unstarted:
            return
        self.unstarted.discard(src)
        if not self.unstarted:
            now = time.perf_counter()
            for a in self.actors.values():
                if a.spec.kind in _GATED and not a.busy:
                    a.since = now
            for c in self.conds.values():
                c.notify_all()

    def _on_ack(self, msg: tuple) -> None:
        _, _, actor, reg, slot, consumer = msg
        a = self.actors[actor]
        if a.outputs[reg].ack(slot, consumer):
            self.left -= 1
            a.since = time.perf_counter()
            self.conds[a.spec.queue].notify()
            self.woke.add(a.spec.queue)

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
                self.rt.shared.failed = True
                # the run's threads waiting in a collective or receive give up now (threads
                # backend): a peer that failed will never join it
                self.comm.interrupt(f"run {self.run_id} of plan {self.rt.plan.name!r} failed "
                                    f"({type(exc).__name__}: {exc})")
                for c in self.conds.values():
                    c.notify_all()
                self.main.notify_all()
        if first and broadcast:
            text = f"{where} failed with {type(exc).__name__}: {exc}"
            if isinstance(exc, ActorAborted):
                text = str(exc)
            culprits = tuple(getattr(exc, "culprits", ()))
            for r in self.peers:
                self._post(r, ("abort", self.run_id, text, culprits))

    def _explained(self, exc: ActorTimeout) -> ActorTimeout:
        """``exc`` with what the plan's ranks are doing, and as its ``culprits`` those that
        wait for no other rank for half the timeout at least (inside an actor's own code, or
        not in the run): `Communicator.whereabouts` (call without the lock: the torch backend
        waits for the ranks' progress records)."""
        found = self.comm.whereabouts(self.rt.plan.ranks, self.rt.timeout / 2)
        if not found.text:
            return exc
        err = ActorTimeout(f"{exc}; the plan's ranks: {found.text}")
        err.culprits = found.culprits
        return err

    def _timed_out(self) -> ActorTimeout | None:
        """An `ActorTimeout` for the first actor waiting longer than the timeout (lock held)."""
        now, limit = time.perf_counter(), self.rt.timeout
        for a in self.actors.values():
            if now - a.since < limit or a.finished():
                continue
            if a.busy:  # a timeout inside its function: a hung collective, an endless loop
                return ActorTimeout(
                    f"actor {a.name!r} ({a.spec.kind}, stage {a.spec.stage}) on rank "
                    f"{self.rank} has been inside its function for {now - a.since:.3g} s "
                    f"(micro-batch {a.fired}); it fired {a.fired} of {a.times} times (timeout "
                    f"{limit:g} s, SBPFLOW_TIMEOUT)")
            if self.gated(a):
                return ActorTimeout(
                    f"actor {a.name!r} ({a.spec.kind}, stage {a.spec.stage}) on rank "
                    f"{self.rank} waited {now - a.since:.3g} s for ranks "
                    f"{sorted(self.unstarted)} to start run {self.run_id} of plan "
                    f"{self.rt.plan.name!r} (every rank of a plan calls run() as often; "
                    f"timeout {limit:g} s, SBPFLOW_TIMEOUT)")
            if a.can_fire():
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
