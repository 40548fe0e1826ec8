"""Spin before blocking: a waiter that polls for a short while finds a message within a few
µs of its arrival, where a blocked one pays the kernel's wake-up (a Python ping-pong between
two processes here: 58-86 µs a round trip blocking in epoll; spinning on shared memory, 0.8).

`spin_poll` polls without blocking, giving the core away between polls (`os.sched_yield`: on
Linux's EEVDF scheduler a task that yields costs a busy neighbour nearly nothing). Once a yield
comes back late, another task wanted the core: a waiter that blocks is then woken ahead of that
task, one that yields queues behind it, so spinning pauses for `PAUSE_S` in the whole process.
``SBPFLOW_SPIN_US`` sets the spin (default `DEFAULT_SPIN_US`; 0 turns it off).
"""

from __future__ import annotations

import os
import time
from typing import Callable

from ..errors import CommError

__all__ = ["DEFAULT_SPIN_US", "PAUSE_S", "spin_budget", "spin_poll"]

DEFAULT_SPIN_US = 2_000  # µs a waiter polls before it blocks (a round trip is ~50 µs)
LATE_S = 1e-3  # a yield this late ran a busy task (its slice: ~4 ms here; our own bursts: µs)
PAUSE_S = 0.1  # s no waiter of this process spins after a late yield
_resume_at = 0.0  # time.perf_counter() when spinning may resume (one word: no lock needed)


def spin_budget() -> float:
    """Seconds a waiter spins: ``SBPFLOW_SPIN_US`` (µs, a number >= 0), else the default."""
    raw = os.environ.get("SBPFLOW_SPIN_US", "").strip()
    if not raw:
        return DEFAULT_SPIN_US / 1e6
    try:
        us = float(raw)
    except ValueError:
        us = float("nan")
    if not us >= 0 or us == float("inf"):
        raise CommError(f"SBPFLOW_SPIN_US={raw!r}: give the µs a waiting thread polls before "
                        f"it blocks, a number >= 0 (0: block at once; default "
                        f"{DEFAULT_SPIN_US})")
    return us / 1e6


def spin_poll(poll: Callable[[], list], budget: float) -> list:
    """``poll()``'s first non-empty answer within ``budget`` s of polling (a yield between two
    polls), or [] when none came, the budget is spent or the core is contended (then no
    spin for `PAUSE_S`): the caller blocks next."""
    global _resume_at
    now = time.perf_counter()
    if budget <= 0 or now < _resume_at:
        return []
    until = now + budget
    while True:
        found = poll()
        if found:
            return found
        before = time.perf_counter()
        if before >= until:
            return []
        os.sched_yield()
        if time.perf_counter() - before > LATE_S:
            _resume_at = time.perf_counter() + PAUSE_S
            return poll()
