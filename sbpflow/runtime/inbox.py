"""The reader of a plan's message channel: one daemon thread per (communicator, channel), kept
from run to run; on the torch backend the store channel's own reader thread (`listen`).

A thread started and joined per run cost each run two thread wake-ups and a message to itself
to stop it. `ensure_reader` starts the reader once; it hands what it reads to the run that is
active on the channel (`Router.active`), keeps the messages of a later run for it
(`Router.early`), and drops those of an earlier one, noting on the way an earlier run's
failure notice (the rank then takes part in the start handshake, see `Router.failed`). It ends
when no `Runtime` of its channel is left, or the thread that started it has ended; a read that
raises (the world aborted) fails the active run and ends the reader (the next run starts
another). On the torch backend the store's reader thread, already woken by each message, routes
it itself (`StoreChannels.listen`): no second thread hop. See docs/runtime.md, 'Actors and
registers'.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable

from ..comm.base import Communicator
from ..comm.channels import StoreChannels, tensor_bytes
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
    runtimes of the channel (the reader ends with the last); ``on_stale_failure(run)``: called
    when a failure notice of run ``run`` (not newer than ``last``) arrives between runs."""

    def __init__(self) -> None:
        self.active: Any = None
        self.last = 0
        self.runtimes: "weakref.WeakSet" = weakref.WeakSet()
        self.reader: threading.Thread | None = None
        self.listening = False  # the store channel's reader routes the messages (`_listen`)
        self.on_stale_failure: Callable[[int], None] | None = None


def route(router: Router, early: list, msgs: list) -> None:
    """Hand ``msgs`` to the active run, or keep a later run's (route lock held)."""
    if router.active is not None:
        router.active.dispatch(msgs)
        return
    for src, msg in msgs:
        if msg[1] > router.last:
            early.append((src, msg))
        elif failure_notice(msg) and router.on_stale_failure is not None:
            router.on_stale_failure(msg[1])


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


def _listen(comm: Communicator, channel: str, router: Router, lock: threading.RLock,
            early: Callable[[], list]) -> bool:
    """Have the torch backend's store reader of ``channel`` route each message as it pops it
    (counted as `Communicator.inbox` counts); False when ``comm`` has no store channels or
    their reader failed (the thread of `_read` then reports the failure)."""
    chan = getattr(comm, "_chan", None)  # TorchCommunicator's StoreChannels, made on first use
    channels = chan() if chan is not None else None
    if not isinstance(channels, StoreChannels):
        return False

    def fail(exc: BaseException) -> None:
        with lock:
            router.listening = False
            if router.active is not None:
                router.active.fail(exc)

    comm_ref = weakref.ref(comm)  # the store's reader thread lives on: keep comm collectable

    def handler(msgs: list) -> None:
        owner = comm_ref()
        if owner is not None:
            owner._count("message", 0, sum(tensor_bytes(m) for _, m in msgs))
        try:
            with lock:
                route(router, early(), msgs)
        except BaseException as exc:  # noqa: BLE001 - a runtime bug: fail the run, keep reading
            fail(exc)

    return channels.listen(comm.rank, channel, handler, fail)


def ensure_reader(comm: Communicator, channel: str, router: Router, lock: threading.RLock,
                  early: Callable[[], list], name: str) -> None:
    """Start the channel's reader unless it runs. ``lock``: the route lock, not held (the
    store's reader takes it while holding its own lock, which `listen` takes)."""
    with lock:
        if router.listening or (router.reader is not None and router.reader.is_alive()):
            return
    if _listen(comm, channel, router, lock, early):
        with lock:
            router.listening = True
        return
    with lock:
        if router.reader is not None and router.reader.is_alive():
            return
        router.reader = threading.Thread(
            target=_read, args=(comm, channel, router, lock, early, threading.current_thread()),
            name=name, daemon=True)
        router.reader.start()
