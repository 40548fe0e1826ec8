"""``sbpflow bench``: run the benchmark scripts of a source checkout (``benchmarks/``, not
installed with the package), each in a new process with this interpreter, printing their
tables. By default the boxing and training benchmarks (what ``make bench`` runs); ``--list``
names every benchmark with its first docstring line."""

from __future__ import annotations

import argparse
import ast
import shlex
import subprocess
import sys
from pathlib import Path

__all__ = ["add_arguments", "bench_command", "benchmarks_dir", "available"]

DEFAULT = ("boxing", "train_gpt")


def benchmarks_dir() -> Path | None:
    """The checkout's ``benchmarks/`` next to the package, or None (an installed package)."""
    d = Path(__file__).resolve().parent.parent / "benchmarks"
    return d if d.is_dir() else None


def available(directory: Path) -> dict[str, str]:
    """``{name: first docstring line}`` of the scripts in ``directory`` that run as a program
    (they have a ``__main__`` block; helper modules such as ``timing.py`` do not)."""
    out = {}
    for path in sorted(directory.glob("*.py")):
        text = path.read_text()
        if "__main__" not in text:
            continue
        doc = ast.get_docstring(ast.parse(text)) or ""
        out[path.stem] = doc.splitlines()[0] if doc else ""
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("names", nargs="*", metavar="NAME",
                   help=f"benchmarks to run (default: {' '.join(DEFAULT)}); see --list")
    p.add_argument("--list", action="store_true", help="name the benchmarks and stop")
    p.add_argument("--args", default="", metavar="'ARGS'",
                   help="arguments given to each benchmark (one quoted string)")


def bench_command(args: argparse.Namespace) -> int:
    """Run the named benchmarks in turn; the exit status is 0 when every one succeeded."""
    directory = benchmarks_dir()
    if directory is None:
        print("sbpflow bench: no benchmarks/ next to the package; the benchmarks come with a "
              "source checkout (git clone the repository, pip install -e .)", file=sys.stderr)
        return 2
    known = available(directory)
    if args.list:
        width = max(map(len, known), default=0)
        for name, line in known.items():
            print(f"{name:{width}s}  {line}")
        return 0
    names = args.names or list(DEFAULT)
    unknown = [n for n in names if n not in known]
    if unknown:
        print(f"sbpflow bench: no benchmark {', '.join(map(repr, unknown))}; one of "
              f"{', '.join(known)}", file=sys.stderr)
        return 2
    failed = []
    for name in names:
        print(f"== benchmarks/{name}.py {args.args}".rstrip(), flush=True)
        done = subprocess.run([sys.executable, str(directory / f"{name}.py"),
                               *shlex.split(args.args)])
        if done.returncode:
            failed.append(name)
    if failed:
        print(f"sbpflow bench: {', '.join(failed)} failed", file=sys.stderr)
    return 1 if failed else 0
