"""The threads a runtime runs its queues on, kept from run to run.

A fresh thread for each queue of each run would cost more than a short step: besides the
thread's start, its first torch kernels set up per-thread state (the BLAS library's buffers).
`Workers` keeps one thread a queue name for the life of its `Runtime` and hands it each run's
loop as a `Job`. A worker whose job never returned (an actor stuck in its function, left
behind by a failed run) is not given another: the queue gets a new thread. A worker ends when
the runtime is closed or garbage, or its owner (the thread that made the runtime) has ended.
"""

from __future__ import annotations

import queue
import threading
import weakref
from typing import Callable

__all__ = ["Job", "Workers"]

_IDLE_CHECK = 0.25  # s between an idle worker's looks at its owner and its runtime


class Job:
    """One run's loop on a worker: ``join`` / ``is_alive`` as a thread's; ``name`` the
    worker's."""

    def __init__(self, fn: Callable[[], None], name: str) -> None:
        self.fn, self.name = fn, name
        self.done = threading.Event()

    def is_alive(self) -> bool:
        return not self.done.is_set()

    def join(self, timeout: float | None = None) -> None:
        self.done.wait(timeout)


def _serve(jobs: queue.SimpleQueue, owner: threading.Thread, alive: Callable[[], bool]) -> None:
    while True:
        try:
            job = jobs.get(timeout=_IDLE_CHECK)
        except queue.Empty:
            if not owner.is_alive() or not alive():
                return
            continue
        if job is None:  # closed
            return
        try:
            job.fn()
        finally:
            job.done.set()


def _close(queues: list) -> None:
    for q in queues:
        q.put(None)
    queues.clear()


class _QueueWorker:
    def __init__(self, name: str, owner: threading.Thread, alive: Callable[[], bool]) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.last: Job | None = None
        threading.Thread(target=_serve, args=(self.jobs, owner, alive), daemon=True,
                         name=name).start()


class Workers:
    """One long-lived thread a queue name (see the module docstring)."""

    def __init__(self) -> None:
        self._owner = threading.current_thread()
        self._workers: dict[str, _QueueWorker] = {}
        self._queues: list[queue.SimpleQueue] = []  # every worker's, for `close`
        ref = weakref.ref(self)
        self._alive = lambda: ref() is not None
        self._finalizer = weakref.finalize(self, _close, self._queues)

    def close(self) -> None:
        """End the idle workers now (a busy one ends after its job)."""
        _close(self._queues)  # (the same list the finalizer closes at garbage collection)
        self._workers.clear()

    def submit(self, name: str, fn: Callable[[], None]) -> Job:
        """Run ``fn`` on the worker of ``name`` (a new one if it is still busy)."""
        w = self._workers.get(name)
        if w is None or (w.last is not None and w.last.is_alive()):
            w = self._workers[name] = _QueueWorker(name, self._owner, self._alive)
            self._queues.append(w.jobs)
        job = w.last = Job(fn, name)
        w.jobs.put(job)
        return job
