"""The actor runtime of one rank: `Runtime(plan).run(micro_batches)` runs the rank's actors.

No central loop orders the work: each queue thread (compute, comm, data, ...) fires the first
of its actors that the firing rule allows, publishes its outputs (``req`` to each consumer) and
acks its inputs (`_PlanRun`, one run). Its messages to other ranks (`messaging`) go over the
Communicator's message channel, read by one reader thread a channel kept from run to run
(`inbox`). Its failures (`supervision`): a failing actor aborts every rank of the plan; an
actor that cannot fire, or stays inside its function, for ``SBPFLOW_TIMEOUT`` s raises
`ActorTimeout`; a run refuses to start while a failed run's thread is left inside an actor.
A rank of a plan that allows it (`Plan.runs_inline`: one queue, no other rank's actors) runs
its actors on the calling thread when its collectives can be interrupted (threads backend).
Every firing is a timeline event. The torch backend's messages travel as typed frames over
authenticated sockets between the ranks (the c10d store as a fallback; `sbpflow.comm.wire`).
See docs/runtime.md, 'Actors and registers'.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from functools import partial
from typing import Any

import torch

from .. import memory
from ..comm.base import Communicator
from ..comm.current import current, rank_local, set_current
from ..comm.threads import ThreadCommunicator, waits_alongside
from ..errors import ActorTimeout, PlanError
from .actors import Actor
from .inbox import Router
from .messaging import RunMessages, register_direct
from .firing_order import FiringOrder
from .specs import Plan
from .supervision import RunSupervisor
from .workers import Job, Workers

__all__ = ["Runtime"]

# after a firing that woke another queue's thread: that thread (a transfer's, mostly) takes the
# core at once instead of waiting for this one's next kernels; on 2 shared cores the send's
# start after a forward went from 0.39 to 0.28 ms, 1F1B's step 4-5% down (docs/runtime.md)
_yield = getattr(os, "sched_yield", lambda: time.sleep(0))
_NO_BLOCK = contextlib.nullcontext()


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
        if not self.left_behind:  # (no run failed with a thread inside an actor: most calls)
            return []
        with self.lock:
            self.left_behind = [(t, a) for t, a in self.left_behind if t.is_alive()]
            return [f"{t.name} (inside {a})" for t, a in self.left_behind]


_STATES: "weakref.WeakKeyDictionary[Communicator, _CommState]" = weakref.WeakKeyDictionary()
_STATES_LOCK = threading.Lock()


def _direct(comm: Communicator) -> bool:
    """Whether reqs and acks go to the receiving run directly (the threads backend)."""
    return isinstance(comm, ThreadCommunicator)


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
        self.direct = bool(_direct(self.comm))  # reqs and acks handed over (`messaging`)
        if self.direct:
            register_direct(self)
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
            # (or where nothing can wait for another rank: a world of one, or a rank whose
            # actors never talk to the communicator, `Plan.solo`)
            can_stop = self.comm.interruptible or self.comm.world_size == 1 or \
                self.rank in self.plan.solo
            self.inline = can_stop and self.plan.runs_inline(self.rank)
        self.runs = self.shared.next_run(self.channel)
        self._run = self._next_run(micro_batches)
        try:
            return self._run.execute_inline() if self.inline else self._run.execute()
        except BaseException:
            with self.shared.lock:
                self.shared.failures += 1
            raise

    def _next_run(self, micro_batches: int) -> "_PlanRun":
        """The state of the run about to start: the last run's actors, registers, queues and
        conditions reset for it when that run ended well on the same plan and micro-batch count
        (built once, not every call: most of a small graph call's cost), else new ones (a
        failed run's threads may still hold its objects)."""
        kept = self._run
        if kept is not None and kept.clean and kept.plan is self.plan and \
                kept.micro_batches == micro_batches:
            kept.reset(self.runs)
            return kept
        return _PlanRun(self, micro_batches)

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
    """One run on one rank: the actors' registers and counts under ``lock``, the queue threads
    that fire them (`execute`; `execute_inline` on the calling thread), their messages
    (``mail``, `messaging.RunMessages`) and their failures and timeouts (``watch``,
    `supervision.RunSupervisor`)."""

    def __init__(self, rt: Runtime, micro_batches: int) -> None:
        self.rt, self.comm, self.rank = rt, rt.comm, rt.rank
        self.plan, self.micro_batches = rt.plan, micro_batches  # what the objects are built for
        self.lock = threading.Lock()
        now = time.perf_counter()
        specs = rt.plan.actors.get(self.rank, [])
        self.actors = {s.name: Actor(s, self.rank, rt.plan, micro_batches, now) for s in specs}
        self.queues: dict[str, list[Actor]] = {}
        for a in self.actors.values():
            self.queues.setdefault(a.spec.queue, []).append(a)
        self.conds = {q: threading.Condition(self.lock) for q in self.queues}
        self.main = threading.Condition(self.lock)
        self.firings = sum(a.times for a in self.actors.values())
        self.inline_actors = [a for q in self.queues.values() for a in q]  # (`execute_inline`)
        self._begin(rt.runs, now)
        self.mail = RunMessages(self)  # (kept for the reused runs: `reset`)
        # the order of this run's firings, once an inline run with no peer ended well: the
        # next runs fire it again without the firing rule (`firing_order`)
        self.order: FiringOrder | None = None
        self.quiet = False  # this run has no peer and no early message (`execute_inline`)
        self.replayed = False  # it fired by `order`: its queues and registers are untouched

    def _begin(self, run_id: int, now: float) -> None:
        """The state of run ``run_id`` besides its actors' (a run's own, reset every run)."""
        self.run_id, self.began = run_id, now
        self.left = self.firings  # firings + slots in flight
        self.over = False
        self.clean = False  # the run ended well: `Runtime._next_run` may reuse its objects
        self.events: list[dict] = []
        self.results: dict[str, list] = {}
        self.woke: set = set()
        self.trackers = memory.active_trackers()  # the caller's `sf.memory.track()` blocks
        self.threads: dict[str, threading.Thread] = {}  # queue -> the thread running it
        self.watch = RunSupervisor(self)

    def reset(self, run_id: int) -> None:
        """Make this (ended well, no thread left in it) run's objects those of run ``run_id``."""
        now = time.perf_counter()
        for a in self.actors.values():
            if self.replayed:
                a.restart(now)
            else:
                a.reset(now)
        self.replayed = False
        self._begin(run_id, now)
        self.mail.restart()

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

    # -- the run ------------------------------------------------------------------------------
    def execute(self) -> dict[str, list]:
        """The run on a thread per queue, this thread supervising; the sinks' values."""
        watch, workers = self.watch, self.rt.workers
        watch.refuse_if_stale()
        activity = self.comm.activity
        activity.started(self)  # (timeout reports read what its actors do: `doing`)
        threads = [workers.submit(f"sbpflow-rank{self.rank}-{q}", partial(self._queue_loop, q))
                   for q in self.queues]
        try:
            self.mail.activate()  # once the queues run: a post may be a store round trip
            watch.supervise()
        except BaseException as exc:  # e.g. KeyboardInterrupt: stop every rank
            watch.fail(exc, None)
            raise
        finally:
            watch.stop(threads)
            activity.ended(self)
        if watch.failure is not None:
            workers.close()  # the next run starts on fresh threads
            raise watch.failure
        self.clean = True
        return self.results

    def execute_inline(self) -> dict[str, list]:
        """The run on the calling thread (`Plan.runs_inline`): the one queue's loop, with the
        supervisor's timeout checks between firings; aborts come in on the channel's reader
        thread, whose interrupt ends a collective an actor waits in. Saves and restores what
        a queue thread sets (the communicator, the grad mode it starts with)."""
        watch = self.watch
        watch.refuse_if_stale()
        local = rank_local()
        previous = local.comm
        exc = None
        activity = self.comm.activity
        self.threads = dict.fromkeys(self.queues, threading.current_thread())
        activity.started(self)
        try:
            self.mail.activate()
            self.quiet = not self.mail.routed  # (nothing can arrive: `firing_order` applies)
            set_current(self.comm)
            waits_alongside(True)  # as on a queue thread: the reader waits beside it
            exc = self._inline_in_context()
        except BaseException as err:  # e.g. KeyboardInterrupt: stop every rank
            watch.fail(err, None)
            raise
        finally:
            waits_alongside(False)
            local.comm = previous
            self.mail.deactivate()
            activity.ended(self)
        if exc is not None:
            watch.fail(watch.explained(exc), None)
        if watch.failure is not None:
            raise watch.failure
        if self.quiet and self.order is None:
            self.order = FiringOrder(self.actors, self.events)
        self.clean = True
        return self.results

    def _inline_in_context(self) -> ActorTimeout | None:
        """`_inline_loop` under the lock, in grad mode and in the caller's `memory.track()`
        blocks, as a queue thread runs; a context only where it changes something (most
        calls: neither a tracker nor grad mode off, and each context is Python calls)."""
        if self.trackers or not torch.is_grad_enabled():
            with memory.attach(self.trackers) if self.trackers else _NO_BLOCK, \
                    torch.enable_grad(), self.lock:
                return self._inline_loop(self.inline_actors)
        with self.lock:
            return self._inline_loop(self.inline_actors)

    def _inline_loop(self, actors: list[Actor]) -> ActorTimeout | None:
        """Fire the actors, first ready first, until all fired (or the run failed); waiting,
        check for timeouts as the supervisor does. Returns the timeout (lock held)."""
        cond = self.conds[actors[0].spec.queue] if actors else self.main
        wait, ready = self.watch.wait, _FirstReady(actors, self.mail.gated)
        try:
            if self.order is not None and self.quiet:
                self.replayed = True
                self.order.run(self, _split)
                return None
            while not self.over:
                a = ready()
                if a is not None:
                    self._fire(a)
                elif not self.left:
                    return None
                else:  # a gated actor waits for the starts, or a plan bug: time it out
                    exc = wait(cond)
                    if exc is not None:
                        return exc
            return None
        finally:
            self.over = True

    # -- threads ------------------------------------------------------------------------------
    def _queue_loop(self, queue: str) -> None:
        """Fire this queue's actors, first ready first, until all fired their times."""
        set_current(self.comm)  # actors' collectives use this rank's communicator
        waits_alongside(True)  # a rank's queue threads may wait at once (a recv, a compute)
        self.threads[queue] = threading.current_thread()
        actors, cond = self.queues[queue], self.conds[queue]
        ready = _FirstReady(actors, self.mail.gated)
        try:
            # tensors the actors save for backward count in the caller's `sf.memory.track()`
            with memory.attach(self.trackers), self.lock:
                while not self.over:
                    a = ready()
                    if a is not None:
                        self._fire(a)
                    elif ready.lo == len(actors):  # (`ready` skipped them: all fired)
                        return
                    else:
                        cond.wait()
        except BaseException as exc:  # noqa: BLE001 - a runtime bug: stop the run, say where
            self.watch.fail(exc, None)
        finally:
            self.mail.ended(queue)  # (a queue that waited on the transport lets it go)
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
                self.watch.fail(exc, a, index)
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
                    self.mail.post(dst, msg)
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
                    self.on_req(msg)
                else:
                    remote.append((c.rank, msg))
        for i, ((rank, producer, _, reg), entry) in enumerate(zip(a.sources, taken)):
            if len(entry) > 3:  # read again by the next firing: no ack yet, but the producer
                if rank == self.rank:  # waiting for it is not idle (GPipe's flush)
                    self.actors[producer].since = end
                continue
            msg = ("ack", self.run_id, producer, reg, entry[0], (self.rank, a.name, i))
            if rank == self.rank:
                self.on_ack(msg)
            else:
                remote.append((rank, msg))
        if self.left == 0 and not self.rt.inline:  # (inline: no supervisor waits on main)
            self.main.notify()
        return remote

    # -- register bookkeeping of a message ----------------------------------------------------
    def on_req(self, msg: tuple) -> None:
        """A ``req``: the value ``msg`` carries joins its consumer's input (lock held)."""
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

    def on_ack(self, msg: tuple) -> None:
        """An ``ack``: the consumer it names is done with the output slot (lock held)."""
        _, _, actor, reg, slot, consumer = msg
        a = self.actors[actor]
        if a.outputs[reg].ack(slot, consumer):
            self.left -= 1
            a.since = time.perf_counter()
            self.conds[a.spec.queue].notify()
            self.woke.add(a.spec.queue)


class _FirstReady:
    """The first actor of a queue's list that may fire now (None if none), as a scan of the
    whole list from its start would find it: actors before the first one with firings left
    can never fire again in the run, so the scan starts past them (a CDP window's actors fire
    once each, mostly in list order: 27 readiness checks a firing became about 2)."""

    __slots__ = ("actors", "gated", "lo")

    def __init__(self, actors: list[Actor], gated) -> None:
        self.actors, self.gated, self.lo = actors, gated, 0

    def __call__(self) -> Actor | None:
        actors, lo = self.actors, self.lo
        n = len(actors)
        while lo < n and actors[lo].fired >= actors[lo].times:
            lo += 1
        self.lo = lo
        gated = self.gated
        for k in range(lo, n):
            a = actors[k]
            if a.can_fire() and not gated(a):
                return a
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
