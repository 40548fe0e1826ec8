"""The ``sbpflow`` command: ``run`` a script on N ranks, ``demo``, ``calibrate``, ``search``,
``bench``."""

from __future__ import annotations

import argparse
import datetime
import os
import runpy
import sys

__all__ = ["main"]


def _run_threads(script: str, argv: list[str], n: int) -> None:
    """Run ``script`` as ``__main__`` on ``n`` rank threads of this process, with ``argv``;
    the process's ``sys.argv`` and ``__main__`` module are as before afterwards."""
    from . import comm

    def rank_main() -> None:
        runpy.run_path(script, run_name="__main__")

    # each rank's run_path swaps sys.modules["__main__"] and puts back what it found: threads
    # interleave, so the last to finish can put back another rank's script module (a later
    # multiprocessing spawn would then re-run the script as its main)
    main_module, old_argv = sys.modules["__main__"], sys.argv
    sys.argv = [script] + argv
    try:
        comm.launch(rank_main, n, backend="threads")
    finally:
        sys.modules["__main__"], sys.argv = main_module, old_argv


_FAIL_GRACE = 5.0  # s the other ranks get to report their own error after one rank fails


def _rank_main() -> None:
    """Body of one ``sbpflow run --backend torch`` process: join the world, run the script.
    A `CommError` (a collective failed: usually because another rank died) exits with
    `EXIT_COMM`, so the launcher can tell the root cause from its consequences."""
    import traceback

    from . import comm
    from .comm.processes import EXIT_COMM
    from .errors import CommError
    comm.init()
    sys.argv = sys.argv[1:]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except CommError:
        traceback.print_exc()
        sys.stderr.flush()
        sys.exit(EXIT_COMM)


def _run_torch(script: str, argv: list[str], n: int) -> int:
    """torchrun-like: n processes on localhost, each joins the gloo world then runs the script.
    When a rank exits with an error the others are stopped (after `_FAIL_GRACE` s, time for
    their own messages), as torchrun does, instead of waiting in collectives until timeout.
    The report names the root cause: a rank that failed other than in a collective, else the
    first rank seen to fail (`sbpflow.comm.processes.run_ranks`)."""
    from .comm.auth import new_secret
    from .comm.base import default_timeout
    from .comm.local_world import loopback_store, rank_env
    from .comm.processes import CommandRank, run_ranks
    # the launcher hosts the store on loopback (rank 0's would listen on every interface)
    store = loopback_store(n, datetime.timedelta(seconds=default_timeout()))
    code = "from sbpflow.cli import _rank_main; _rank_main()"
    secret = new_secret()

    def start(r: int) -> CommandRank:
        env = dict(os.environ, **rank_env(r, n, store.port, secret))
        env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: n ranks x all cores thrash
        return CommandRank([sys.executable, "-c", code, script] + argv, env)

    try:
        outcome = run_ranks(start, n, grace=_FAIL_GRACE, settle=_FAIL_GRACE, tick=0.05)
    finally:
        del store
    root = outcome.root
    if root is None:
        return 0
    msg = f"sbpflow run: rank {root} failed (exit code {outcome.reports[root].payload})"
    others = [r for r in outcome.failed if r != root]
    if others:
        msg += f"; rank(s) {others} failed after it"
    if outcome.stopped:
        msg += f"; rank(s) {outcome.stopped} were stopped"
    print(msg, file=sys.stderr)
    return 1


def _rank_count(text: str) -> int:
    """``-n``: a count of ranks, at least 1 (a usage error otherwise)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an int: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"a run needs at least 1 rank, got {n}")
    return n


def main(argv: list[str] | None = None) -> int:
    """The ``sbpflow`` command: parse ``argv`` (default ``sys.argv[1:]``), run the sub-command,
    return its exit code (see the command-line reference)."""
    parser = argparse.ArgumentParser(prog="sbpflow", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a script on N ranks (SPMD: every rank runs it)")
    run.add_argument("-n", "--nproc", type=_rank_count, default=4,
                     help="number of ranks (default 4)")
    run.add_argument("--backend", choices=["threads", "torch"], default="threads",
                     help="threads: one thread a rank in this process; torch: gloo processes")
    run.add_argument("script")
    run.add_argument("args", nargs=argparse.REMAINDER)
    from .demo import add_arguments as demo_arguments
    demo_arguments(sub.add_parser("demo", help="boxing on 4 simulated ranks, then train a GPT "
                                  "in a 2x2 layout (--seconds), then on a 4-stage pipeline "
                                  "in graph mode"))
    from .cost.calibrate import add_arguments as calibrate_arguments
    calibrate_arguments(sub.add_parser("calibrate", help="time collectives on N ranks, fit "
                                       "alpha/beta, write a cluster file"))
    from .auto.search_cli import add_arguments as search_arguments
    search_arguments(sub.add_parser("search", help="search a parallel strategy for a preset "
                                    "model on a modelled cluster"))
    from .bench import add_arguments as bench_arguments
    bench_arguments(sub.add_parser("bench", help="run the benchmark scripts of a source "
                                   "checkout (default: boxing, train_gpt; --list)"))
    args = parser.parse_args(argv)
    if args.command == "bench":
        from .bench import bench_command
        return bench_command(args)
    if args.command == "calibrate":
        from .cost.calibrate import calibrate_command
        return calibrate_command(args)
    if args.command == "search":
        from .auto.search_cli import search_command
        return search_command(args)
    if args.command == "run":
        if args.backend == "threads":
            _run_threads(args.script, args.args, args.nproc)
            return 0
        return _run_torch(args.script, args.args, args.nproc)
    if args.command == "demo":
        from .demo import main as demo_main
        demo_main(args)
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
