"""The reader of a plan's message channel: one daemon thread per (communicator, channel), kept
from run to run, or none where the communicator hands messages over itself.

A thread started and joined per run cost each run two thread wake-ups and a message to itself
to stop it. `ensure_reader` has the communicator's receiving thread hand the channel's messages
over (`Communicator.listen`: the torch backend's socket receiver; no reader thread's wake-up a
message), else starts the reader once. Either hands what it reads to the run that is active on
the channel (`Router.active`), keeps the messages of a later run for it (`Router.early`), and
drops those of an earlier one, noting on the way an earlier run's failure notice (the rank then
takes part in the start handshake, see `Router.failed`). A reader ends when no `Runtime` of its
channel is left, or the thread that started it has ended; a read that raises (the world
aborted) fails the active run and ends the reader (the next run starts another). See
docs/runtime.md, 'Actors and registers'.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable

from ..comm.base import Communicator
from ..comm.current import set_current

__all__ = ["Router", "ensure_reader", "failure_notice", "route"]

_POLL = 0.05  # s between the reader's looks at its runtimes and its owner


def failure_notice(msg: tuple) -> bool:
    """An ``abort``, or a ``start`` that refuses the run: the sender's run failed."""
    return msg[0] == "abort" or (msg[0] == "start" and msg[2] is not None)


class Router:
    """Where one channel's messages go (guarded by the communicator state's ``route`` lock):
    ``active``: the run under way on this rank (``None`` between runs), which has
    ``dispatch(msgs)``; ``last``: the id of the last run made active; ``runtimes``: the live
    runtimes of the channel (the reader ends with the last); ``on_stale_failure``: a weak
    method, called ``(run)`` when a failure notice of run ``run`` (not newer than ``last``)
    arrives between runs."""

    def __init__(self) -> None:
        self.active: Any = None
        self.last = 0
        self.runtimes: "weakref.WeakSet" = weakref.WeakSet()
        self.reader: threading.Thread | None = None
        self.on_stale_failure: "weakref.WeakMethod | None" = None


def route(router: Router, early: list, msgs: list) -> None:
    """Hand ``msgs`` to the active run, or keep a later run's (route lock held)."""
    if router.active is not None:
        router.active.dispatch(msgs)
        return
    for src, msg in msgs:
        if msg[1] > router.last:
            early.append((src, msg))
        elif failure_notice(msg) and router.on_stale_failure is not None:
            call = router.on_stale_failure()   # (a weak method: None once its run is gone)
            if call is not None:
                call(msg[1])


def _read(comm: Communicator, channel: str, router: Router, lock: threading.RLock,
          early: Callable[[], list], owner: threading.Thread) -> None:
    set_current(comm)
    try:
        while True:
            with lock:
                if not owner.is_alive() or not len(router.runtimes):
                    router.reader = None
                    return
            try:
                msgs = comm.inbox(channel, _POLL)
            except BaseException as exc:  # noqa: BLE001 - e.g. CommAborted: a rank died
                with lock:
                    router.reader = None
                    if router.active is not None:
                        router.active.fail(exc)
                return
            if msgs:
                with lock:
                    route(router, early(), msgs)
    finally:
        set_current(None)


class _Listening:
    """``Router.reader`` of a channel the communicator hands over (`Communicator.listen`)
    until its receiving fails."""

    def __init__(self) -> None:
        self.alive = True

    def is_alive(self) -> bool:
        return self.alive


def _listen(comm: Communicator, channel: str, router: Router, lock: threading.RLock,
            early: Callable[[], list]) -> bool:
    """Have the communicator's receiving thread route the channel's messages (lock held)."""
    mark, me = _Listening(), weakref.ref(comm)

    def deliver(msgs: list) -> None:
        set_current(me())  # (what the reader thread's dispatch ran under)
        with lock:
            try:
                route(router, early(), msgs)
            except BaseException as exc:  # noqa: BLE001 - a runtime bug: fail the run, go on
                if router.active is not None:
                    router.active.fail(exc)

    def failed(exc: BaseException) -> None:
        with lock:
            mark.alive = False
            if router.reader is mark:
                router.reader = None
            if router.active is not None:
                router.active.fail(exc)

    router.reader = mark
    if comm.listen(channel, deliver, failed):
        return True
    router.reader = None
    return False


def ensure_reader(comm: Communicator, channel: str, router: Router, lock: threading.RLock,
                  early: Callable[[], list], name: str) -> None:
    """Start the channel's reader unless it runs (``lock``: the route lock, held or not), or
    have the communicator hand the messages over (`Communicator.listen`)."""
    with lock:
        if router.reader is not None and router.reader.is_alive():
            return
        if _listen(comm, channel, router, lock, early):
            return
        router.reader = threading.Thread(
            target=_read, args=(comm, channel, router, lock, early, threading.current_thread()),
            name=name, daemon=True)
        router.reader.start()
