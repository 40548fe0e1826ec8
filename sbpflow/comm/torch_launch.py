"""`launch_processes`: a world of rank processes on this host for the torch backend (gloo), one
new process a rank, each running ``fn`` and reporting its result, its exception or its death to
the launcher (`processes.run_ranks`). See docs/internals.md, 'Rank processes'.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import sys
import threading
import traceback
from typing import Any, Callable, Sequence

import torch

from ..errors import CommError, CommTimeout, SbpError
from .auth import SECRET_ENV, new_secret
from .base import default_timeout
from .current import current_process, set_current
from .local_world import loopback_store, rank_env
from .processes import Outcome, RankProcess, Report, run_ranks
from .torch_backend import init_from_env, shutdown

__all__ = ["launch_processes"]

_GRACE = 2.0  # s to wait for a root cause after a rank reports a CommError (run_ranks)


def _threads_per_rank(world_size: int) -> int:
    env = os.environ.get("SBPFLOW_THREADS_PER_RANK")
    if env:
        return max(1, int(env))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // world_size)


def _child(rank: int, world_size: int, port: int, env: dict, fn: Callable, args: tuple,
           kwargs: dict, conn: multiprocessing.connection.Connection) -> None:
    """Body of a launched rank: init gloo, run ``fn``, send ``("ok", result, "")`` or
    ``("error" | "comm_error", exception, traceback text)`` on ``conn``, exit."""
    os.environ.clear()  # the parent's environment at launch (a forkserver child has the server's)
    os.environ.update(env, **rank_env(rank, world_size, port, env[SECRET_ENV]))
    torch.set_num_threads(int(env["SBPFLOW_THREADS_PER_RANK"]))
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    try:
        comm = init_from_env("gloo")
        set_current(comm, process_wide=True)
        result = fn(*args, **kwargs)
        try:
            msg = pickle.dumps(("ok", result, ""))
        except Exception as exc:  # noqa: BLE001
            raise CommError(f"the result of rank {rank} cannot be pickled: {exc!r}") from None
        # no rank leaves before all are done: a rank that exits early can break a slower
        # peer's gloo connection set-up ("Connection closed by peer" in connectFullMesh)
        comm.barrier()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        kind = ("comm_timeout" if isinstance(exc, CommTimeout) else  # maybe a consequence
                "comm_error" if isinstance(exc, CommError) else "error")
        try:
            msg = pickle.dumps((kind, exc, tb))
            pickle.loads(msg)
        except Exception:  # noqa: BLE001
            msg = pickle.dumps((kind, CommError(f"{type(exc).__name__}: {exc} (unpicklable "
                                                f"exception; traceback below)"), tb))
        conn.send_bytes(msg)
        _exit(1)  # the parent stops the other ranks; skip teardown that could block
    conn.send_bytes(msg)
    shutdown()
    _exit(0)


def _exit_with_parent() -> None:
    """Never outlive the launching process (no orphaned ranks if it is killed)."""
    parent = mp.parent_process()
    if parent is not None:
        mp.connection.wait([parent.sentinel])
        os._exit(1)


def _exit(code: int) -> None:
    """Leave at once: interpreter teardown of torch costs about a second a rank."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _launch_timeout(timeout: float | None) -> float:
    """Bound on a whole ``launch(backend="torch")`` run: ``SBPFLOW_LAUNCH_TIMEOUT`` seconds,
    default max(1 hour, 4 × the collective timeout)."""
    default = max(3600.0, 4 * (timeout or default_timeout()))
    return float(os.environ.get("SBPFLOW_LAUNCH_TIMEOUT", default))


def _mp_context() -> Any:
    """``SBPFLOW_START_METHOD``, default forkserver (else spawn). Neither forks a process that
    runs threads; forkserver imports torch once per parent and forks ranks from that server,
    where spawn imports torch in every rank (measured on 2 cores, 4 ranks: ~1 s vs ~8 s)."""
    methods = mp.get_all_start_methods()
    method = os.environ.get("SBPFLOW_START_METHOD") or \
        ("forkserver" if "forkserver" in methods else "spawn")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(["torch", "torch.distributed", __name__])
    return ctx


def launch_processes(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (),
                     kwargs: dict | None = None, timeout: float | None = None) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` in ``world_size`` new processes (`_mp_context`) joined by gloo.

    Returns the results in rank order. On failure the root cause is raised here (with notes
    naming the rank and holding its traceback) and the other ranks are terminated: an
    exception a rank raised, as soon as it is reported; else a rank that died without
    reporting (`CommError` with its exit code); else, after waiting up to `_GRACE` s for one
    of those, a rank's `CommError`, which is often just the effect of another rank's failure
    (`sbpflow.comm.processes` holds this policy). A run longer than `_launch_timeout` raises
    `CommError`. ``timeout`` bounds each collective (default ``SBPFLOW_TIMEOUT``).
    Each rank uses ``SBPFLOW_THREADS_PER_RANK`` torch threads (default cores // world_size).
    """
    kwargs = dict(kwargs or {})
    _check_launchable(fn, args, kwargs)
    env = dict(os.environ, SBPFLOW_THREADS_PER_RANK=str(_threads_per_rank(world_size)),
               **{SECRET_ENV: new_secret()})  # this world's own, whatever the caller's
    if timeout is not None:
        env["SBPFLOW_TIMEOUT"] = str(timeout)
    store_timeout = datetime.timedelta(seconds=timeout or default_timeout())
    store = loopback_store(world_size, store_timeout)
    ctx, bound = _mp_context(), _launch_timeout(timeout)
    job = (store.port, env, fn, tuple(args), kwargs)  # what each rank's `_child` is given

    def start(r: int) -> _RankProcess:
        return _RankProcess(ctx, r, world_size, job)

    try:
        # ranks that reported get a moment (linger) to tear down before they are terminated
        outcome = run_ranks(start, world_size, grace=_GRACE, bound=bound, linger=10.0)
    finally:
        del store  # not kept alive by a traceback's frames
    return _results(outcome, world_size, bound)


def _check_launchable(fn: Callable, args: Sequence[Any], kwargs: dict) -> None:
    """Refuse a launch that cannot work: from a rank process importing the main script, or of
    a function or arguments that cannot be pickled to the rank processes."""
    if getattr(mp.current_process(), "_inheriting", False):
        # a rank process re-imports the main script (forkserver / spawn); a script that calls
        # launch at module level would start processes from each of them, without end
        raise CommError("sf.launch(..., backend='torch') was called while a rank process was "
                        "importing the script that started it: put the call under "
                        "`if __name__ == '__main__':` (every rank process imports the main "
                        "module, as multiprocessing's spawn and forkserver do)")
    try:
        pickle.dumps(fn)
    except Exception as exc:  # noqa: BLE001
        raise SbpError(f"launch(backend='torch') runs {fn!r} in other processes, so it must "
                       f"be a module-level (importable) function: {exc}") from None
    try:
        pickle.dumps((tuple(args), kwargs))
    except Exception as exc:  # noqa: BLE001
        raise SbpError(f"launch(backend='torch'): args and kwargs must be picklable: {exc}") \
            from None


class _RankProcess(RankProcess):
    """A launched rank (`_child` in a process of ``ctx``) as `run_ranks` watches it: it reports
    ``(kind, payload, traceback)`` over a pipe; a rank that exits without one is ``dead``."""

    def __init__(self, ctx: Any, rank: int, world_size: int, job: tuple) -> None:
        self.rank, self.world_size = rank, world_size
        self.conn, send_end = ctx.Pipe(duplex=False)
        # Not daemonic, so fn may start processes (data loaders); run_ranks stops it.
        self.proc = ctx.Process(target=_child, name=f"sbpflow-rank{rank}",
                                args=(rank, world_size, *job, send_end))
        try:
            self.proc.start()
        except BaseException:
            self.conn.close()
            raise
        finally:
            send_end.close()

    def waitables(self) -> list:
        return [self.conn, self.proc.sentinel]

    def report(self) -> Report | None:
        alive = self.proc.is_alive()  # before poll(): a dead rank has written all it will
        if self.conn.poll():
            try:
                return Report(*pickle.loads(self.conn.recv_bytes()))
            except EOFError:  # the rank's end closed without a report
                pass
        elif alive:
            return None
        self.proc.join()
        return Report("dead", CommError(
            f"rank {self.rank} of {self.world_size} died with exit code {self.proc.exitcode} "
            f"without reporting a result or an exception (crashed or killed; its stderr, "
            f"above, may say why)"))

    def is_alive(self) -> bool:
        return self.proc.is_alive()

    def join(self, timeout: float | None) -> None:
        self.proc.join(timeout)

    def close(self) -> None:
        self.conn.close()


def _results(outcome: Outcome, n: int, bound: float) -> list[Any]:
    """The ranks' results in rank order; or raise the root cause's exception (noted with its
    rank and traceback), or `CommError` when ranks ran past ``bound``."""
    r = outcome.root
    if r is not None:
        report = outcome.reports[r]
        exc = report.payload
        if hasattr(exc, "add_note"):
            exc.add_note(f"raised on rank {r} of {n} (sbpflow torch backend)")
            if report.detail:
                exc.add_note(f"traceback on rank {r}:\n{report.detail.rstrip()}")
        raise exc
    if outcome.unfinished:
        raise CommError(f"launch(backend='torch'): rank(s) {outcome.unfinished} of {n} still "
                        f"running after SBPFLOW_LAUNCH_TIMEOUT={bound:g} s; terminated")
    return [report.payload for report in outcome.reports]
