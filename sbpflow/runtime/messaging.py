"""The messages of one run on one rank: `RunMessages` posts and hands out a run's messages.

A message is a tuple ``(kind, run id, ...)``: ``req`` (a value for a consumer's input),
``ack`` (a consumer is done with an output slot), ``start`` (the sender started the run, or
refuses it) and ``abort`` (the sender's run failed). They travel on the plan's channel of the
Communicator, read by the channel's reader (`inbox`); on the threads backend a ``req`` or
``ack`` is handed to the receiving run by the sender's thread (`register_direct`). Once a run
failed on the communicator the start handshake gates the actors that talk to the communicator
themselves (`GATED`): they fire once every rank of the plan started the run, so they never
pair with an abandoned collective. The register bookkeeping of a req or ack is the run's
(``run.on_req`` / ``run.on_ack``), the failure's its supervisor's (`supervision`). Where the
transport can (`Communicator.leads`), the queue most fed by other ranks waits on the transport
itself (`_Leading`): the kernel wakes its thread for a message, not a receiver thread.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any

from ..comm.channels import copy_tensors, tensor_bytes
from ..errors import ActorAborted, CommError, PlanError
from .actors import Actor
from .inbox import ensure_reader, failure_notice, route

__all__ = ["GATED", "RunMessages", "register_direct"]

GATED = ("collective", "send", "recv")  # kinds whose fn may talk to the communicator directly:
# after a failed run they fire only once every rank of the plan started the run with no thread
# left behind, so they never pair with that run's abandoned collective

# threads backend: each world's (rank, channel) -> (router, comm state, communicator), so that
# a req or ack is handed to the receiving run by the sender's thread (`RunMessages.post`); read
# and written under _DIRECT_LOCK
_DIRECT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_DIRECT_LOCK = threading.Lock()


def register_direct(rt: Any) -> None:
    """Let the senders of the threads backend hand ``rt``'s channel its reqs and acks. Those
    they posted before (its runtime did not exist yet) are taken from the channel now, under
    the same lock as the senders' choice, so they keep their order before the direct ones."""
    with _DIRECT_LOCK:
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


class _Leading(threading.Condition):
    """A queue's condition (of the run's lock) whose waiting thread reads the transport itself
    (`Communicator.lead`) when no other thread does: a message for the queue costs one thread
    wake-up, the kernel's. A `notify` from another thread rings the leader's bell. Where the
    transport cannot lead (another thread leads), the wait returns once (the caller's loop
    checks again, as after any wake-up) and is a plain condition's from then on."""

    def __init__(self, lock: threading.Lock, comm: Any) -> None:
        super().__init__(lock)
        self.comm = comm
        self.leader: int | None = None  # the waiting thread's ident while it leads
        self.can_lead = True

    def wait(self, timeout: float | None = None) -> bool:
        if not self.can_lead or self.leader is not None:
            return super().wait(timeout)
        self.leader = threading.get_ident()
        self._release_save()
        try:
            led = self.comm.lead(timeout)
        finally:
            self._acquire_restore(None)
            self.leader = None
        self.can_lead = led
        return True

    def notify(self, n: int = 1) -> None:
        if self.leader is not None and self.leader != threading.get_ident():
            self.comm.wake_leader()
        super().notify(n)

    def end(self) -> None:
        """The queue waits no more this run: the transport's receiver reads again at once."""
        self.can_lead = False
        self.comm.lead_end()


def _leading_queue(run: Any) -> str | None:
    """The queue of ``run`` whose actors have the most inputs from or consumers on other
    ranks (None: none has any)."""
    links: dict[str, int] = {}
    for a in run.actors.values():
        n = sum(1 for src in a.sources if src[0] != run.rank)
        n += sum(1 for reg in a.outputs for c in reg.consumers if c.rank != run.rank)
        if n:
            links[a.spec.queue] = links.get(a.spec.queue, 0) + n
    return max(links, key=links.get) if links else None


class RunMessages:
    """The messaging of one run (``run``, a `_PlanRun`) on one rank. Out: `post` to one rank,
    `tell_peers` to every other rank of the plan; a post never raises, a failed one fails the
    run. In: while the run is its channel's active one (`activate` .. `deactivate`), the
    channel's reader calls `dispatch` (or `fail` when it cannot read): a message of this run
    goes to the actors under ``run.lock``, a later run's is kept, an earlier one's dropped.
    The handshake: `gated` says whether an actor waits for the peers' ``start``."""

    def __init__(self, run: Any) -> None:
        self.run, self.rt, self.comm = run, run.rt, run.comm
        self.rank, self.channel = run.rank, run.rt.channel
        self.peers = [r for r in run.rt.plan.ranks if r != self.rank]
        # actor names as numbers in the reqs and acks to other ranks (`_compact`)
        self.ids, self.names = run.rt.plan.actor_ids()
        self.leading = _leading_queue(run) if self.peers and self.comm.leads else None
        self.routed = False  # the channel's reader hands this run its messages (`activate`)
        # (weakly: the communicator's shared state outlives the run, and a strong reference
        # kept the run, its runtime, and so the communicator itself and all that a graph
        # holds, its data loader's processes too, alive as long as the process)
        self._stale = weakref.WeakMethod(self.stale_failure)
        # (what the channel's reader keeps for a later run: no reference to this object, which
        # a listening reader would keep alive as long as the communicator)
        shared, channel = run.rt.shared, self.channel
        self._early = lambda: shared.early.setdefault(channel, [])
        self._reader_name = f"sbpflow-rank{self.rank}-inbox"
        self.restart()

    def restart(self) -> None:
        """The messaging of the run's new id (``run.run_id``): the run's objects are reused
        for its next run (`_PlanRun.reset`: the same plan and actors)."""
        run = self.run
        self.run_id = run.run_id
        # the ranks whose "start" has not arrived: until then gated actors (GATED) wait, once a
        # run has failed on this communicator (`_CommState.failed`)
        self.unstarted = set(self.peers)
        self.careful = run.rt.shared.failed
        self.posted_start = False  # this run's start went to the peers (see `stale_failure`)
        if self.leading is not None:  # (the run's conditions are made, not used yet)
            run.conds[self.leading] = _Leading(run.lock, self.comm)

    def gated(self, a: Actor) -> bool:
        """Whether ``a`` may not fire yet: it talks to the communicator, a run failed on it,
        and a peer's start has not arrived."""
        return self.careful and bool(self.unstarted) and a.spec.kind in GATED

    # -- the channel --------------------------------------------------------------------------
    def activate(self) -> None:
        """Make this run the channel's active one (its reader hands it the messages, those
        that came early first) and, after a failed run (`gated`), tell the other ranks it
        started. Until a run fails no rank waits for a start: posting it would cost every run
        a message to each peer (a store round trip each on the torch backend)."""
        shared, router = self.rt.shared, self.rt.router
        if not self.peers and not shared.early.get(self.channel):
            # no other rank in the plan: nothing arrives for this run (a one-rank graph call
            # skips the route lock and the reader's bookkeeping)
            router.last = self.run_id
            return
        self.routed = True
        if self.peers:
            ensure_reader(self.comm, self.channel, router, shared.route, self._early,
                          self._reader_name)
        with shared.route:
            router.active, router.last = self, self.run_id
            router.on_stale_failure = self._stale
            if self.careful:
                self.post_start()
            self.dispatch(shared.early.pop(self.channel, []))

    def deactivate(self) -> None:
        """From now on the channel's reader keeps (a later run's) or drops this run's messages;
        a queue that waited on the transport (`_Leading`) lets it go."""
        if not self.routed:  # (`activate`: no other rank; no queue waited on the transport)
            return
        self.routed = False
        for queue in self.run.conds:
            self.ended(queue)
        with self.rt.shared.route:
            if self.rt.router.active is self:
                self.rt.router.active = None

    def ended(self, queue: str) -> None:
        """``queue``'s thread waits no more this run: if it waited on the transport
        (`_Leading`), the transport's receiver thread reads at once (a sender's last acks)."""
        cond = self.run.conds.get(queue)
        if isinstance(cond, _Leading):
            cond.end()

    def fail(self, exc: BaseException) -> None:
        """Fail the run (its channel's reader could not read)."""
        self.run.watch.fail(exc, None)

    # -- out ----------------------------------------------------------------------------------
    def tell_peers(self, msg: tuple) -> None:
        """`post` ``msg`` to every other rank of the plan."""
        for r in self.peers:
            self.post(r, msg)

    def post(self, dst: int, msg: tuple) -> None:
        """Post ``msg``; never raises (it runs while stopping): a failed post fails the run.
        On the threads backend a ``req`` or ``ack`` is handed to the receiving rank's run by
        this thread (`_deliver`): no wake-up of the receiver's reader thread a message."""
        try:
            if msg[0] in ("req", "ack") and self.rt.direct:
                with _DIRECT_LOCK:  # against `register_direct`: no post after its look
                    target = _DIRECT.get(self.comm.world, {}).get((dst, self.channel))
                    if target is None:  # the receiver's runtime does not exist yet
                        self.comm.post(dst, self.channel, msg)
                        return
                self._deliver(target, msg)
                return
            self.comm.post(dst, self.channel, self._compact(msg))
        except Exception as exc:  # noqa: BLE001 - e.g. the world aborted, the store is gone
            if msg[0] == "abort":  # already stopping: the first failure stands
                return
            if not isinstance(exc, CommError):
                err = CommError(f"rank {self.rank}: posting a {msg[0]!r} message to rank {dst} "
                                f"on channel {self.channel!r} failed with "
                                f"{type(exc).__name__}: {exc}")
                err.__cause__, exc = exc, err
            self.run.watch.fail(exc, None)

    def _compact(self, msg: tuple) -> tuple:
        """A ``req`` or ``ack`` with numbers for its actor names (`Plan.actor_ids`): a message
        of ints (and a req's value), which the transport sends as a fixed-size binary record
        (`sbpflow.comm.records`); other messages as they are."""
        kind, ids = msg[0], self.ids
        if kind == "req":
            return ("req", msg[1], ids[msg[2]]) + msg[3:]
        if kind == "ack":
            rank, name, i = msg[5]
            return ("ack", msg[1], ids[msg[2]], msg[3], msg[4], rank, ids[name], i)
        return msg

    def _expand(self, msg: tuple) -> tuple:
        """`_compact`'s message with its actor names back (`PlanError` for a number that names
        no actor of this plan: the ranks run different plans)."""
        names = self.names
        try:
            if msg[0] == "req":
                return ("req", msg[1], names[msg[2]]) + msg[3:]
            _, run, producer, reg, slot, rank, consumer, i = msg
            return ("ack", run, names[producer], reg, slot, (rank, names[consumer], i))
        except (KeyError, ValueError):
            raise PlanError(f"rank {self.rank}: a {msg[0]!r} message {msg[:8]} names an actor "
                            f"that plan {self.rt.plan.name!r} does not have (do all ranks run "
                            f"the same plan?)") from None

    def _deliver(self, target: tuple, msg: tuple) -> None:
        """Hand ``msg`` to the run active on the receiver's channel, or keep it for a later
        run, as its reader would (its route lock taken, no lock of this rank held: the
        receiver's dispatch of a req or ack posts nothing). Counted and copied as a post."""
        router, shared, comm_ref = target
        size = tensor_bytes(msg)
        self.comm._count("message", size, 0)
        msg = copy_tensors(msg)
        with shared.route:
            route(router, shared.early.setdefault(self.channel, []), [(self.rank, msg)])
        comm = comm_ref()
        if comm is not None:
            comm._count("message", 0, size)

    # -- in -----------------------------------------------------------------------------------
    def dispatch(self, msgs: list[tuple[int, tuple]]) -> None:
        """Hand the messages read from the channel to the actors (the route lock held)."""
        if not msgs:
            return
        run = self.run
        aborts, stale = [], False
        with run.lock:
            for src, msg in msgs:
                if msg[1] > self.run_id:
                    self.rt.shared.early.setdefault(self.channel, []).append((src, msg))
                elif msg[1] < self.run_id:
                    stale = stale or failure_notice(msg)
                    continue
                elif msg[0] == "req":
                    run.on_req(msg if type(msg[2]) is str else self._expand(msg))
                elif msg[0] == "ack":
                    run.on_ack(msg if type(msg[2]) is str else self._expand(msg))
                elif msg[0] == "abort":  # (text, the culprits the failure names)
                    aborts.append((msg[2], msg[3] if len(msg) > 3 else ()))
                elif msg[0] == "start":
                    if msg[2] is not None:
                        aborts.append((msg[2], ()))
                    self._on_start(src)
            if run.left == 0:
                run.main.notify()
        if stale:
            self.stale_failure(self.run_id)
        for text, culprits in aborts:
            err = ActorAborted(f"{text}; the runtime of rank {self.rank} stopped")
            err.culprits = tuple(culprits)  # (a failure that named them names them here too)
            run.watch.fail(err, None, broadcast=False)

    # -- the start handshake ------------------------------------------------------------------
    def _on_start(self, src: int) -> None:
        """Rank ``src`` started this run: once all did, the gated actors may fire (their
        wait for a timeout starts now). Lock held."""
        if src not in self.unstarted:
            return
        self.unstarted.discard(src)
        if not self.unstarted:
            now = time.perf_counter()
            for a in self.run.actors.values():
                if a.spec.kind in GATED and not a.busy:
                    a.since = now
            for c in self.run.conds.values():
                c.notify_all()

    def post_start(self) -> None:
        """Tell the other ranks this run started."""
        self.posted_start = True
        self.tell_peers(("start", self.run_id, None))

    def stale_failure(self, run: int) -> None:
        """A rank says an earlier run (``run``) failed, after this rank's part of it ended: the
        failure's ranks wait for every start from now on, this run's included."""
        self.rt.shared.failed = True
        if not self.posted_start:
            self.post_start()
