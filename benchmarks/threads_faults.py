"""Threads backend under faults: how long ``sf.launch`` takes to raise after the first failure.

Each row runs one faulty program on in-process ranks (``backend="threads"``) and prints the
exception ``launch`` raised, the time from the first exception leaving any rank's function (or,
for a rank that never fails, the collective timeout firing) to ``launch`` raising, the whole
run's time, and the ranks reported as still running. Then the cost of a small all-reduce (the
rendezvous overhead, where the agreement check of the ranks lives).

    python benchmarks/threads_faults.py [--stuck 10] [--timeout 1] [--calls 2000]
"""

from __future__ import annotations

import argparse
import re
import threading
import time
import warnings

import torch

import sbpflow as sf
from sbpflow.comm import current


class _FirstFailure:
    """The monotonic time of the first exception that leaves a rank's function."""

    def __init__(self) -> None:
        self.at: float | None = None
        self.lock = threading.Lock()

    def wrap(self, fn):
        def body(*args):
            try:
                return fn(*args)
            except BaseException:
                with self.lock:
                    self.at = self.at or time.monotonic()
                raise
        return body


class _Fail(torch.autograd.Function):
    """Identity forward; its backward raises on rank 1."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if sf.rank() == 1:
            raise RuntimeError("rank 1 fails inside backward")
        return g


def raises_before_collective(stuck):
    if sf.rank() == 2:
        raise ValueError("rank 2 fails")
    current().barrier()


def raises_inside_backward(stuck):
    pl = sf.placement("cpu", [0, 1])
    x = sf.randn(4, 4, placement=pl, sbp=sf.S(0), seed=0, requires_grad=True)
    y = x.to_global(sbp=sf.B)  # its backward is a reduce-scatter: rank 0 waits there
    z = sf.from_local(_Fail.apply(y.local), placement=pl, sbp=sf.B)
    z.backward(sf.ones(4, 4, placement=pl, sbp=sf.P))


def stuck_in_compute(stuck):
    if sf.rank() == 1:
        time.sleep(stuck)  # pure Python / torch work: nothing can interrupt it
    current().all_reduce(torch.ones(2), (0, 1))


def stuck_in_collective(stuck):
    r = sf.rank()
    if r == 0:
        time.sleep(0.2)
        raise ValueError("rank 0 fails")
    if r == 2:
        time.sleep(stuck)
    current().all_reduce(torch.ones(2), (1, 2))  # rank 1 waits here for the sleeping rank 2


def returns_early(stuck):
    if sf.rank() == 0:
        current().barrier()


def mismatched_sizes(stuck):
    current().all_reduce(torch.ones(1 if sf.rank() == 0 else 3), (0, 1))


def mismatched_groups(stuck):
    current().all_reduce(torch.ones(1), (0, 1) if sf.rank() == 0 else (1, 0))


def mismatched_kinds(stuck):
    c = current()
    if c.rank == 0:
        c.all_reduce(torch.ones(2), (0, 1))
    else:
        c.all_gather(torch.ones(2), (0, 1), [(2,), (2,)])


CASES = [("raises before a collective", raises_before_collective, 4),
         ("raises inside backward", raises_inside_backward, 2),
         ("stuck in compute (sleep), others wait", stuck_in_compute, 2),
         ("stuck in a collective, another raises", stuck_in_collective, 3),
         ("returns without joining", returns_early, 2),
         ("all_reduce of 1 vs 3 elements", mismatched_sizes, 2),
         ("groups (0, 1) vs (1, 0)", mismatched_groups, 2),
         ("all_reduce vs all_gather", mismatched_kinds, 2)]


def run_case(fn, world_size: int, stuck: float, timeout: float) -> tuple:
    """(exception name, seconds from first failure to raise, whole run, stuck-rank report)."""
    first = _FirstFailure()
    t0 = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            sf.launch(first.wrap(fn), world_size=world_size, args=(stuck,), timeout=timeout)
            name = "(no error)"
        except BaseException as exc:  # noqa: BLE001 - reported in the table
            name = type(exc).__name__
    end = time.monotonic()
    after = end - first.at if first.at is not None else float("nan")
    left = [re.search(r"rank\(s\) \[[\d, ]*\]", str(w.message)) for w in caught]
    return name, after, end - t0, " ".join(m.group(0) for m in left if m)


def all_reduce_cost(calls: int, repeats: int = 5) -> float:
    """Microseconds per 1-element all-reduce on 2 ranks (best of ``repeats``)."""
    def body():
        c, x = current(), torch.ones(1)
        best = float("inf")
        for _ in range(repeats):
            c.barrier()
            t = time.perf_counter()
            for _ in range(calls):
                c.all_reduce(x, (0, 1))
            best = min(best, time.perf_counter() - t)
        return best / calls * 1e6
    return max(sf.launch(body, world_size=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stuck", type=float, default=10.0, help="seconds a stuck rank sleeps")
    ap.add_argument("--timeout", type=float, default=1.0, help="collective timeout (s)")
    ap.add_argument("--calls", type=int, default=2000, help="all-reduces timed per repeat")
    a = ap.parse_args()
    print(f"{'fault':40s} {'raised':14s} {'after 1st fail':>14s} {'run':>7s}  still running")
    for title, fn, n in CASES:
        name, after, total, left = run_case(fn, n, a.stuck, a.timeout)
        print(f"{title:40s} {name:14s} {after:12.3f} s {total:5.2f} s  {left}")
    print(f"all_reduce of 1 float on 2 threads ranks: {all_reduce_cost(a.calls):.1f} us/call")


if __name__ == "__main__":
    main()
