"""``launch`` (a new world of ranks: threads or processes) and ``init`` (join torchrun's world);
the calling rank's communicator itself is kept in `sbpflow.comm.current`."""

from __future__ import annotations

import os
import threading
import warnings
from typing import Any, Callable, Sequence

from ..errors import CommAborted, SbpError
from .base import Communicator
from .current import _local, current, set_current
from .threads import ThreadCommunicator, ThreadWorld
from .torch_backend import init_from_env, launch_processes

__all__ = ["launch", "init"]


def launch(fn: Callable[..., Any], world_size: int, backend: str = "threads",
           args: Sequence[Any] = (), kwargs: dict | None = None,
           timeout: float | None = None) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on every rank of a new world; return the per-rank results.

    ``backend="threads"`` runs one thread a rank in this process; ``backend="torch"`` spawns
    ``world_size`` processes joined by torch.distributed (gloo on localhost); ``fn`` and its
    arguments must then be picklable. If a rank raises, the others stop within about a second
    and the first rank's original exception is re-raised here, with a note naming its rank;
    with threads, ``launch`` raises about a second after the first failure even if a rank is
    stuck in its own code (that rank is left running as a daemon thread, named in a note on
    the exception and in a `RuntimeWarning`).
    ``timeout`` (seconds, default ``SBPFLOW_TIMEOUT`` or 300) bounds every collective's wait.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise SbpError(f"world_size must be a positive int, got {world_size!r}")
    kwargs = kwargs or {}
    if backend == "threads":
        return _launch_threads(fn, world_size, tuple(args), kwargs, timeout)
    if backend == "torch":
        return launch_processes(fn, world_size, tuple(args), kwargs, timeout)
    raise SbpError(f"unknown backend {backend!r}; use 'threads' or 'torch'")


_GRACE = 1.0  # seconds the other ranks get to stop after the first failure


def _launch_threads(fn, world_size, args, kwargs, timeout) -> list[Any]:
    """One thread a rank. On the first failure the others get `_GRACE` s to stop (a rank
    waiting in a collective stops within `_POLL`); then the root cause is raised, and ranks
    still running (stuck in their own code, which no one can interrupt) are left behind as
    daemon threads of their own, aborted world, named in a note and a warning."""
    world = ThreadWorld(world_size, timeout)
    results: list[Any] = [None] * world_size
    errors: list[tuple[int, BaseException]] = []
    errors_lock = threading.Lock()

    def body(r: int) -> None:
        _local.comm = ThreadCommunicator(world, r)
        try:
            results[r] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller
            with errors_lock:
                errors.append((r, exc))
            world.abort(r, exc)
        finally:
            world.finish(r)
            _local.comm = None

    threads = [threading.Thread(target=body, args=(r,), name=f"sbpflow-rank{r}", daemon=True)
               for r in range(world_size)]
    for t in threads:
        t.start()
    try:
        world.wait_ranks(_GRACE)
    except BaseException as exc:  # e.g. KeyboardInterrupt: stop the ranks' communication too
        world.abort(-1, exc)
        raise
    with errors_lock:  # a rank left behind may still add to ``errors``
        raised = list(errors)
    if not raised:
        return results
    # The root cause is the first error that is not another rank's abort.
    r, exc = next(((r, e) for r, e in raised if not isinstance(e, CommAborted)), raised[0])
    _add_note(exc, f"raised on rank {r} of {world_size} (sbpflow threads backend)")
    _report_stuck(world, exc)
    raise exc


def _report_stuck(world: ThreadWorld, exc: BaseException) -> None:
    """Name the ranks still running after the grace, and what each is doing, on ``exc`` and in
    a `RuntimeWarning`. Their world is aborted: any communication they try raises at once."""
    with world.cond:
        stuck = [r for r in range(world.world_size) if r not in world.finished]
        if not stuck:
            return
        states = "; ".join(world.describe(r) for r in stuck)
    msg = (f"rank(s) {stuck} of {world.world_size} still running {_GRACE:g} s after the "
           f"failure, left behind as daemon threads (their communication now raises "
           f"CommAborted): {states}")
    _add_note(exc, msg)
    warnings.warn(f"sbpflow launch: {msg}", RuntimeWarning, stacklevel=4)


def _add_note(exc: BaseException, note: str) -> None:
    if hasattr(exc, "add_note"):
        exc.add_note(note)


def init(backend: str | None = None) -> Communicator:
    """Join the torch.distributed world described by the environment (torchrun).

    Uses gloo, or nccl when ``backend="nccl"``. Idempotent. Inside `launch` it returns the
    rank's communicator; without torchrun's environment it is a single-rank world.
    """
    existing = _local.comm
    if existing is not None:
        return existing  # already a rank of a launched world (e.g. `sbpflow run`)
    if "WORLD_SIZE" not in os.environ and backend is None:
        return current()  # plain `python script.py`: a single-rank world
    comm = init_from_env(backend)
    set_current(comm, process_wide=True)
    return comm
