"""A loading thread with a register budget: `Prefetcher` runs ``load(0), load(1), ...`` on a
daemon thread, at most ``budget`` batches ahead of what `Prefetcher.get` has handed out.

The budget is a semaphore of ``budget`` slots: the thread takes a slot before it loads a batch
and `get` frees it when it hands the batch out, so loaded-but-not-consumed batches never exceed
``budget``. The thread holds no reference to its `Prefetcher`; it stops when the `Prefetcher`
is closed or garbage, or when the thread that made it has ended. `get` waits at most
``timeout`` seconds (`DataLoaderError`), and re-raises a loading error on the consumer.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from typing import Any, Callable

from ..errors import DataLoaderError

__all__ = ["Prefetcher"]

_POLL = 0.05  # seconds between looks at the stop flag (how fast an abandoned thread stops)


def _take_slot(slots: threading.Semaphore, stop: threading.Event,
               owner: threading.Thread) -> bool:
    """Wait for a free slot; False once the loading must stop."""
    while not slots.acquire(timeout=_POLL):
        if stop.is_set() or not owner.is_alive():
            return False
    return not stop.is_set()


def _produce(load: Callable[[int], Any], start: int, count: int, slots: threading.Semaphore,
             out: queue.SimpleQueue, stop: threading.Event, owner: threading.Thread) -> None:
    """The thread's body: ``(b, value, True)`` for each batch from ``start`` into ``out``; a
    failing ``load`` puts ``(b, exc, False)`` and ends the thread."""
    for b in range(start, count):
        if not _take_slot(slots, stop, owner):
            return
        try:
            value = load(b)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, raised there
            out.put((b, exc, False))
            return
        out.put((b, value, True))


def _halt(stop: threading.Event, slots: threading.Semaphore) -> None:
    stop.set()
    slots.release()  # wakes a thread waiting for a slot at once


class Prefetcher:
    """Loads batches ``start..count-1`` with ``load`` on a daemon thread named ``name``, at
    most ``budget`` (>= 1) batches ahead of `get`. ``describe()`` says what the loading is
    doing (for the timeout message). The thread stops when ``owner`` (default: the calling
    thread) has ended. ``start > 0``: the rest of an epoch whose first batches came from
    elsewhere (a worker feed gone stale)."""

    def __init__(self, load: Callable[[int], Any], count: int, budget: int, name: str,
                 timeout: float, describe: Callable[[], str],
                 owner: threading.Thread | None = None, start: int = 0) -> None:
        self._slots = threading.Semaphore(budget)
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._timeout, self._describe, self._name = timeout, describe, name
        self._thread = threading.Thread(
            target=_produce, name=name, daemon=True,
            args=(load, start, count, self._slots, self._out, self._stop,
                  owner or threading.current_thread()))
        self._close = weakref.finalize(self, _halt, self._stop, self._slots)
        self._thread.start()

    def get(self, b: int) -> Any:
        """Batch ``b`` (the next one): waits for the thread, frees its slot, re-raises the
        thread's error; raises `DataLoaderError` after ``timeout`` seconds."""
        deadline = time.monotonic() + self._timeout
        while True:
            try:
                got, value, ok = self._out.get(timeout=_POLL)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._out.empty():
                    raise DataLoaderError(f"DataLoader: the loading thread {self._name} ended "
                                          f"without batch {b}") from None
                if time.monotonic() > deadline:
                    raise DataLoaderError(
                        f"DataLoader: waited {self._timeout:g} s for batch {b} from "
                        f"{self._name} (SBPFLOW_TIMEOUT or DataLoader(timeout=)); it is "
                        f"{self._describe()}") from None
        if not ok:
            raise value
        if got != b:  # the thread loads in order; anything else is a bug here
            raise DataLoaderError(f"DataLoader: expected batch {b} from {self._name}, got {got}")
        self._slots.release()
        return value

    def close(self) -> None:
        """Stop the thread (it finishes the sample it is reading, if any)."""
        self._close()
