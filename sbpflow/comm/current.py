"""Which communicator the calling rank uses.

Inside ``launch(..., backend="threads")`` each rank thread has its own communicator
(thread-local). Under torchrun, ``init()`` sets one for the process. Outside both, a
single-rank world is created on first use, so sbpflow also works as plain single-device code.
"""

from __future__ import annotations

import threading
from typing import Callable

from .base import Communicator, CommStats
from .threads import ThreadCommunicator, ThreadWorld

__all__ = ["current", "rank_local", "rank", "world_size", "stats", "reset_stats",
           "is_initialized", "set_current", "current_process", "at_rank_exit"]


class _RankLocal(threading.local):
    comm: Communicator | None = None  # a class default: reading it never raises (hot path)


_local = _RankLocal()
_process: Communicator | None = None
_process_lock = threading.Lock()


def set_current(comm: Communicator | None, *, process_wide: bool = False) -> None:
    """Make ``comm`` the calling thread's (or the whole process's) communicator."""
    global _process
    if process_wide:
        _process = comm
    else:
        _local.comm = comm


def current_process() -> Communicator | None:
    """The process-wide communicator (`init` under torchrun), if any."""
    return _process


def rank_local() -> threading.local:
    """The thread-local whose ``.comm`` is the calling rank thread's communicator (None outside
    `launch`'s rank threads, where `current` falls back to the process's): for hot paths that
    read it before calling `current`."""
    return _local


def is_initialized() -> bool:
    """Whether this thread is a rank of a world (a launched rank, or a process that joined one)."""
    return _local.comm is not None or _process is not None


def current() -> Communicator:
    """The calling rank's communicator (a single-rank world if none was set up)."""
    global _process
    comm = _local.comm
    if comm is not None:
        return comm
    if _process is None:
        with _process_lock:
            if _process is None:
                _process = ThreadCommunicator(ThreadWorld(1), 0)
    return _process


def at_rank_exit(callback: Callable[[], object]) -> bool:
    """Call ``callback()`` when the calling rank's launched function ends, normally or by an
    exception: on a rank of ``sf.launch(..., backend="threads")`` or ``sbpflow run`` (from
    any thread of the rank: its actors', its loaders'), before `launch` returns or raises.
    Returns whether it was registered: ``False`` where no such end is known (plain code's
    single-rank world, which lasts as long as the process; a rank process of the torch
    backend, whose end is the process's). A bound method is held weakly (registering does not
    keep its object alive); see `ExitHooks`."""
    hooks = getattr(_local.comm, "exit_hooks", None)
    if hooks is None:
        return False
    hooks.add(callback)
    return True


def rank() -> int:
    """This rank's global id."""
    return current().rank


def world_size() -> int:
    """Number of ranks in the world."""
    return current().world_size


def stats() -> CommStats:
    """Bytes this rank sent and received, per kind, since the last `reset_stats`."""
    return current().stats()


def reset_stats() -> None:
    """Zero this rank's byte counters (`sf.comm.stats()`)."""
    current().reset_stats()
