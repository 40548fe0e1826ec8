"""``launch`` (a new world of ranks: threads or processes; or, inside a world a launcher
started, that world) and ``init`` (join torchrun's world); the calling rank's communicator
itself is kept in `sbpflow.comm.current`."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
import warnings
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..errors import CommAborted, CommError, CommTimeout, SbpError, WireError
from .base import Communicator
from .current import _local, current, current_process, set_current
from .threads import ExitHooks, ThreadCommunicator, ThreadWorld
from .torch_backend import init_from_env
from .torch_launch import launch_processes
from .wire import encode, parse_frame

__all__ = ["launch", "init"]

_RESULT = "sbpflow.launch.result"  # the frames' channel name (they travel by all-gather)


def launch(fn: Callable[..., Any], world_size: int | None, backend: str = "threads",
           args: Sequence[Any] = (), kwargs: dict | None = None,
           timeout: float | None = None) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on every rank of a world; return the per-rank results.

    Outside any world: a new one. ``backend="threads"`` runs one thread a rank in this
    process; ``backend="torch"`` spawns ``world_size`` processes joined by torch.distributed
    (gloo on localhost); ``fn`` and its arguments must then be picklable. If a rank raises,
    the others stop within about a second and the first rank's original exception is
    re-raised here, with a note naming its rank; with threads, ``launch`` raises about a second
    after the first failure even if a rank is stuck in its own code (that rank is left running
    as a daemon thread, named in a note on the exception and in a `RuntimeWarning`).
    ``timeout`` (seconds, default ``SBPFLOW_TIMEOUT`` or 300) bounds every collective's wait.

    Inside a world (this is a rank of ``launch`` or ``sbpflow run``, or a launcher such as
    torchrun set ``RANK`` / ``WORLD_SIZE``, or torch.distributed is initialised): no second
    world. ``fn`` runs on this rank of that world (joined with `init` if need be), and every
    rank gets the list of all ranks' results (on the torch backend they must be picklable).
    ``world_size`` must be that world's size (``None``: whatever it is), else `CommError`;
    ``backend`` and ``timeout`` are not used.
    """
    kwargs = kwargs or {}
    comm = _existing_world()
    if comm is not None:
        return _run_in_world(comm, fn, world_size, tuple(args), kwargs)
    if world_size is None:
        raise SbpError("launch(world_size=None) runs on the world a launcher started "
                       "(torchrun, sbpflow run), and there is none: give world_size")
    if not isinstance(world_size, int) or world_size < 1:
        raise SbpError(f"world_size must be a positive int, got {world_size!r}")
    if backend == "threads":
        return _launch_threads(fn, world_size, tuple(args), kwargs, timeout)
    if backend == "torch":
        return launch_processes(fn, world_size, tuple(args), kwargs, timeout)
    raise SbpError(f"unknown backend {backend!r}; use 'threads' or 'torch'")


# -- inside an existing world ----------------------------------------------------------------------
def _existing_world() -> Communicator | None:
    """This rank's communicator when the caller already is a rank of a world, else None: a
    rank thread (`launch`, ``sbpflow run``), a process that joined torch.distributed, or one
    whose launcher set ``RANK`` and ``WORLD_SIZE`` (joined here). The single-rank world plain
    code gets on first use is not one (a `ThreadCommunicator` set process-wide)."""
    comm = _local.comm
    if comm is not None:
        return comm
    process = current_process()
    if process is not None and not isinstance(process, ThreadCommunicator):
        return process
    if getattr(mp.current_process(), "_inheriting", False):
        return None  # a spawned rank importing its main script: `launch_processes` says why
    if dist.is_initialized() or ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
        return init()
    return None


def _run_in_world(comm: Communicator, fn: Callable, world_size: int | None, args: tuple,
                  kwargs: dict) -> list[Any]:
    n = comm.world_size
    if world_size is not None and world_size != n:
        started = ("sf.launch or `sbpflow run` (rank threads)" if _local.comm is not None else
                   "torch.distributed: torchrun, `sbpflow run --backend torch`, or another "
                   "launcher that set RANK / WORLD_SIZE")
        raise CommError(
            f"sf.launch(fn, world_size={world_size}) was called on rank {comm.rank} of a world "
            f"of {n} rank(s) started by {started}. sbpflow runs fn on that world instead of "
            f"starting a second one beside it: start {world_size} ranks (torchrun "
            f"--nproc-per-node {world_size}, sbpflow run -n {world_size}), or pass "
            f"world_size={n} (or None: the world's own size)")
    result = fn(*args, **kwargs)
    if n == 1:
        return [result]
    if isinstance(comm, ThreadCommunicator):
        return _share_results(comm, result)
    return _gather_results(comm, result)


def _share_results(comm: ThreadCommunicator, result: Any) -> list[Any]:
    """Every rank thread's result, on every rank: posted by reference on a message channel
    (one per call; an aborted world raises while waiting)."""
    comm.per_rank.launch_calls += 1
    calls = comm.per_rank.launch_calls
    channel = f"sbpflow.launch.results.{calls}"
    n, me = comm.world_size, comm.rank
    for dst in range(n):
        if dst != me:
            comm.post(dst, channel, result)
    results: list[Any] = [None] * n
    results[me] = result
    missing = set(range(n)) - {me}
    deadline = time.monotonic() + comm.world.timeout
    while missing:
        left = deadline - time.monotonic()
        if left <= 0:
            raise CommTimeout(f"sf.launch on rank {me}: rank(s) {sorted(missing)} did not "
                              f"finish fn within {comm.world.timeout:g} s of this rank "
                              f"(SBPFLOW_TIMEOUT)")
        for src, value in comm.inbox(channel, min(left, 0.05)):
            results[src] = value
            missing.discard(src)
    return results


def _gather_results(comm: Communicator, result: Any) -> list[Any]:
    """Every rank process's result, on every rank: a `wire` frame each (plain data and
    tensors; nothing received is unpickled), all-gathered."""
    try:
        data = b"".join(encode(comm.rank, _RESULT, result))
    except WireError as exc:
        raise CommError(f"sf.launch: the result of rank {comm.rank} cannot be sent to the "
                        f"other ranks ({exc}); return plain values (numbers, strings, torch "
                        f"tensors, tuples, lists and dicts of them) or None") from None
    payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    pieces = comm.all_gather(payload, list(range(comm.world_size)))
    return [parse_frame(p.numpy().tobytes())[2] for p in pieces]


_GRACE = 1.0  # seconds the other ranks get to stop after the first failure


def _launch_threads(fn, world_size, args, kwargs, timeout) -> list[Any]:
    """One thread a rank. On the first failure the others get `_GRACE` s to stop (a rank
    waiting in a collective stops within `_POLL`); then the root cause is raised, and ranks
    still running (stuck in their own code, which no one can interrupt) are left behind as
    daemon threads of their own, aborted world, named in a note and a warning. A rank's
    `at_rank_exit` hooks run when its function ends, before the rank counts as finished.

    No reference cycle runs through the raised exception (its traceback holds this frame and
    the ranks' frames, which hold the rank functions' locals: models, loaders with worker
    processes): the exceptions are taken out of ``errors`` and this frame's locals before the
    raise, and the world keeps the failure's text only. Dropping the exception frees them at
    once, without waiting for the garbage collector."""
    world = ThreadWorld(world_size, timeout)
    results: list[Any] = [None] * world_size
    errors: list[tuple[int, BaseException]] = []
    errors_lock = threading.Lock()

    def body(r: int) -> None:
        comm = _local.comm = ThreadCommunicator(world, r, exit_hooks=ExitHooks())
        try:
            results[r] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller
            with errors_lock:
                errors.append((r, exc))
            world.abort(r, exc)
        finally:
            try:
                comm.exit_hooks.run(r)
            finally:  # a KeyboardInterrupt in a hook still finishes the rank
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
        errors.clear()  # the ranks' frames (in each traceback) hold ``errors``: no cycle
    if not raised:
        return results
    # The root cause is the first error that is not another rank's abort.
    r, exc = next(((r, e) for r, e in raised if not isinstance(e, CommAborted)), raised[0])
    _add_note(exc, f"raised on rank {r} of {world_size} (sbpflow threads backend)")
    _report_stuck(world, exc)
    try:
        raise exc
    finally:  # this frame joins the traceback: it must not hold the exception
        del exc, raised


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
