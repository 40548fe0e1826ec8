"""ZeRO's collectives off the rank's own thread, so they overlap its compute (docs/zero.md,
'Overlap'): a thread that submits jobs has a long-lived worker that runs them in order, on the
collective stream ``"zero"`` (``"<stream>/zero"`` for a thread in a named collective stream: a
graph's forward and backward actors each have their own worker, since the order in which one
rank's actors fire may differ from another rank's). Every rank submits the same jobs in the same
order per stream, so a worker's collectives pair with the other ranks' workers'. A job's
exception is re-raised by ``Future.result()`` on the submitting thread.

A worker ends when the thread that made it has ended (checked when idle), like the runtime's.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Callable

from .. import comm as _comm
from ..comm.threads import waits_alongside

__all__ = ["submit", "STREAM"]

STREAM = "zero"
_IDLE_CHECK = 0.25   # s between an idle worker's looks at its owner thread


class _Worker:
    __slots__ = ("jobs", "thread", "closed")

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self.closed = False   # set under the lock once the worker will take no more jobs


_LOCK = threading.Lock()   # a worker's decision to end and a submit to it do not interleave


def _serve(w: _Worker, comm, owner: threading.Thread, stream: str) -> None:
    _comm.set_current(comm)
    _comm.set_collective_stream(stream)
    # the owner may wait in its own collectives meanwhile: the threads backend's deadlock
    # check, which follows one waiting thread a rank, must not chain through this one's waits
    waits_alongside(True)
    while True:
        try:
            job = w.jobs.get(timeout=_IDLE_CHECK)
        except queue.Empty:
            if owner.is_alive():
                continue
            with _LOCK:
                if w.jobs.empty():   # (a job put since the timeout is run first)
                    w.closed = True
                    return
            continue
        fut, fn, args = job
        if not fut.set_running_or_notify_cancel():
            continue
        try:
            fut.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to the submitting thread
            fut.set_exception(exc)
        # an idle worker holds no result: a gather's buffers are freed when its user is done
        job = fut = fn = args = None


def submit(fn: Callable, *args) -> Future:
    """Run ``fn(*args)`` on the ZeRO worker of this rank and of the calling thread's collective
    stream, after the jobs submitted to it before."""
    comm = _comm.current()
    named = _comm.collective_stream()
    stream = STREAM if named is None else f"{named}/{STREAM}"
    fut: Future = Future()
    with _LOCK:
        workers = comm.per_rank.zero_workers
        w = workers.get(stream)
        if w is None or w.closed:
            w = workers[stream] = _Worker()
            w.thread = threading.Thread(
                target=_serve, args=(w, comm, threading.current_thread(), stream),
                daemon=True, name=f"sbpflow-{stream}-{comm.rank}")
            w.thread.start()
        w.jobs.put((fut, fn, args))
    return fut
