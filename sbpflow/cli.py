"""The ``sbpflow`` command: ``run`` a script on N ranks, ``demo``, ``calibrate``."""

from __future__ import annotations

import argparse
import os
import runpy
import subprocess
import sys

__all__ = ["main"]


def _run_threads(script: str, argv: list[str], n: int) -> None:
    from . import comm

    def rank_main() -> None:
        runpy.run_path(script, run_name="__main__")

    sys.argv = [script] + argv
    comm.launch(rank_main, n, backend="threads")


_FAIL_GRACE = 5.0  # s the other ranks get to report their own error after one rank fails


def _run_torch(script: str, argv: list[str], n: int) -> int:
    """torchrun-like: n processes on localhost, each joins the gloo world then runs the script.
    When a rank exits with an error the others are stopped (after `_FAIL_GRACE` s, time for
    their own messages), as torchrun does, instead of waiting in collectives until timeout."""
    import socket
    import time
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(n):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(n),
                   LOCAL_WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: n ranks x all cores thrash
        code = ("import runpy, sys, sbpflow as sf; sf.init(); sys.argv = sys.argv[1:]; "
                "runpy.run_path(sys.argv[0], run_name='__main__')")
        procs.append(subprocess.Popen([sys.executable, "-c", code, script] + argv, env=env))
    stop_at = None
    try:
        while any(p.poll() is None for p in procs):
            failed = [p for p in procs if p.returncode not in (None, 0)]
            if failed and stop_at is None:
                stop_at = time.monotonic() + _FAIL_GRACE
            if stop_at is not None and time.monotonic() >= stop_at:
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    codes = [p.returncode for p in procs]
    bad = [(r, c) for r, c in enumerate(codes) if c != 0]
    if bad:
        print(f"sbpflow run: rank(s) {[r for r, _ in bad]} exited with {[c for _, c in bad]}",
              file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sbpflow", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a script on N ranks (SPMD: every rank runs it)")
    run.add_argument("-n", "--nproc", type=int, default=4, help="number of ranks (default 4)")
    run.add_argument("--backend", choices=["threads", "torch"], default="threads",
                     help="threads: one thread a rank in this process; torch: gloo processes")
    run.add_argument("script")
    run.add_argument("args", nargs=argparse.REMAINDER)
    from .demo import add_arguments as demo_arguments
    demo_arguments(sub.add_parser("demo", help="boxing on 4 simulated ranks, then train a GPT "
                                  "in a 2x2 layout (--seconds)"))
    from .cost.calibrate import add_arguments as calibrate_arguments
    calibrate_arguments(sub.add_parser("calibrate", help="time collectives on N ranks, fit "
                                       "alpha/beta, write a cluster file"))
    from .auto.cli import add_arguments as search_arguments
    search_arguments(sub.add_parser("search", help="search a parallel strategy for a preset "
                                    "model on a modelled cluster"))
    args = parser.parse_args(argv)
    if args.command == "calibrate":
        from .cost.calibrate import calibrate_command
        return calibrate_command(args)
    if args.command == "search":
        from .auto.cli import search_command
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
