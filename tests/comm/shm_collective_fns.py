"""Rank functions of tests/comm/test_shm_collectives.py (each rank imports them by name)."""

from __future__ import annotations

import torch

import sbpflow as sf
from gloo_fns import _REDUCE, _t
from sbpflow.comm.shm_collectives import SHM_MIN

BIG = SHM_MIN // 4 * 3  # float32 elements: 3 x the bytes from which the shared-memory path runs


def _in_order(ts: list, op: str) -> torch.Tensor:
    """The threads backend's reduction: in group order (a sum one tensor after another)."""
    return _REDUCE[op](ts)


def _mapped() -> bool:
    with open("/proc/self/maps") as f:
        return "sbpflow-collectives" in f.read()


def collectives() -> dict:
    """Even all-gathers and all-reduces above the threshold on several groups, many calls in a
    row (the halves alternate), each checked against its exact value; returns what went
    through shared memory."""
    comm = sf.comm.current()
    r = comm.rank
    n = comm.world_size
    groups = [tuple(range(n)), tuple(reversed(range(n))), (n - 1, 0)]
    for call in range(5):
        for group in groups:
            if r not in group:
                continue
            x = _t(100 * call + r, BIG + call)
            got = comm.all_gather(x, group, shapes=[tuple(x.shape)] * len(group),
                                  assemble=torch.cat)
            want = torch.cat([_t(100 * call + m, BIG + call) for m in group])
            assert torch.equal(got, want), ("all_gather", call, group)
            for op, dtype in [("sum", torch.float32), ("max", torch.float32),
                              ("min", torch.int64), ("sum", torch.float64)]:
                x = _t(1000 * call + 7 * r, 3, BIG // 3 + call, dtype=dtype)
                before = x.clone()
                got = comm.all_reduce(x, group, op)
                assert torch.equal(x, before), "all_reduce modified its input"
                want = _in_order([_t(1000 * call + 7 * m, 3, BIG // 3 + call, dtype=dtype)
                                  for m in group], op)
                assert got.dtype == dtype and torch.equal(got, want), ("all_reduce", op, group)
    # started and waited later, in place on a contiguous tensor, as the gradient buckets do
    x = _t(5 + r, BIG)
    got = comm.all_reduce_start(x, groups[0], "sum", inplace=True).wait()
    want = _in_order([_t(5 + m, BIG) for m in groups[0]], "sum")
    assert torch.equal(got, want) and torch.equal(x, want), "all_reduce_start in place"
    return {"mapped": _mapped(),
            "groups": sorted(k[0] for k, v in comm._shm.items() if v is not None)}


def too_big() -> dict:
    """A tensor that does not fit a half-segment goes through gloo, with the same result."""
    comm = sf.comm.current()
    group = tuple(range(comm.world_size))
    x = _t(comm.rank, 1 << 18)   # 1 MiB, in a 1 MiB segment: over its half
    got = comm.all_reduce(x, group, "max")
    want = _in_order([_t(m, 1 << 18) for m in group], "max")
    assert torch.equal(got, want)
    small = comm.all_reduce(_t(comm.rank, BIG), group, "max")
    assert torch.equal(small, _in_order([_t(m, BIG) for m in group], "max"))
    return {"mapped": _mapped()}


def dies_in_collective() -> None:
    """Rank 1 exits in the middle: the others' shared-memory all-reduce must fail, not hang."""
    import os
    comm = sf.comm.current()
    group = tuple(range(comm.world_size))
    comm.all_reduce(_t(comm.rank, BIG), group, "sum")   # sets the segments up
    if comm.rank == 1:
        os._exit(3)
    comm.all_reduce(_t(comm.rank, BIG), group, "sum")
