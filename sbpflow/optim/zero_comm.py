"""ZeRO's collectives off the rank's own thread, so they overlap its compute (docs/zero.md,
'Overlap'): each rank has one long-lived worker thread that runs the jobs it is given in order,
on the collective stream ``"zero"`` (its collectives pair with the other ranks' workers', in
that order, whatever the rank threads do meanwhile). Every rank submits the same jobs in the
same order. A job's exception is re-raised by ``Future.result()`` on the rank's thread.

The worker ends when its rank thread has ended (checked when idle), like the runtime's.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Callable

from .. import comm as _comm

__all__ = ["submit", "STREAM"]

STREAM = "zero"
_IDLE_CHECK = 0.25   # s between an idle worker's looks at its rank thread


def _serve(jobs: queue.SimpleQueue, comm, owner: threading.Thread) -> None:
    _comm.set_current(comm)
    _comm.set_collective_stream(STREAM)
    while True:
        try:
            job = jobs.get(timeout=_IDLE_CHECK)
        except queue.Empty:
            if not owner.is_alive():
                return
            continue
        fut, fn, args = job
        if not fut.set_running_or_notify_cancel():
            continue
        try:
            fut.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to the rank thread
            fut.set_exception(exc)


def submit(fn: Callable, *args) -> Future:
    """Run ``fn(*args)`` on this rank's ZeRO worker, after the jobs submitted before it."""
    comm = _comm.current()
    state = comm.state
    w = state.get("zero_worker")
    if w is None or not w[1].is_alive():
        jobs: queue.SimpleQueue = queue.SimpleQueue()
        t = threading.Thread(target=_serve, args=(jobs, comm, threading.current_thread()),
                             daemon=True, name=f"sbpflow-zero-{comm.rank}")
        t.start()
        w = state["zero_worker"] = (jobs, t)
    fut: Future = Future()
    w[0].put((fut, fn, args))
    return fut
