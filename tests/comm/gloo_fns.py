"""Functions that `test_torch_backend` launches on 4 gloo ranks.

They live here, not in the test module, because every rank imports the module of the launched
function by name: this one is cheap to import (no pytest; no ``torch.testing``, which pulls in
DTensor and sympy, ~4 s a rank). pytest's default import mode puts this directory on
``sys.path``, and the ranks inherit the parent's ``sys.path``.
"""

from __future__ import annotations

import os
import time

import torch

import sbpflow as sf
from sbpflow.comm import current

P = 4
WORLD = tuple(range(P))


def _t(seed: int, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The same tensor on every rank for the same seed (the 'other ranks' inputs')."""
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=dtype)
    return torch.randint(-100, 100, shape, generator=g, dtype=dtype)


def _eq(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b), \
        f"{what}: got {a.dtype} {tuple(a.shape)} {a}, expected {b.dtype} {tuple(b.shape)} {b}"


def _nb(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _ordered_sum(ts: list[torch.Tensor]) -> torch.Tensor:
    out = ts[0]
    for t in ts[1:]:
        out = out + t
    return out


_REDUCE = {"sum": _ordered_sum,
           "max": lambda ts: torch.stack(ts).amax(0),
           "min": lambda ts: torch.stack(ts).amin(0)}


# -- launched functions (run on every rank) -----------------------------------------------------
def collectives_fn() -> dict:
    comm = current()
    r = comm.rank
    assert comm.backend == "torch" and comm.world_size == P and sf.comm.rank() == r
    out: dict = {}

    # all_gather: even, uneven (rank 0 holds an empty piece), unsorted groups, subgroups
    x = _t(r, 2, 3)
    got = comm.all_gather(x, WORLD, shapes=[(2, 3)] * P)
    for j in WORLD:
        _eq(got[j], _t(j, 2, 3), f"all_gather even piece {j}")
    un = [_t(10 + j, j, 3) for j in WORLD]
    got = comm.all_gather(un[r], WORLD, shapes=[tuple(u.shape) for u in un],
                          assemble=lambda ps: torch.cat(ps))
    _eq(got, torch.cat(un), "all_gather uneven, world")
    for group in [(2, 0, 3, 1), (3, 1), (2, 0, 3)]:
        if r in group:
            pieces = [_t(20 + j, j + 1, 2, dtype=torch.int64) for j in group]
            got = comm.all_gather(pieces[group.index(r)], group,
                                  shapes=[tuple(p.shape) for p in pieces])
            for k, j in enumerate(group):
                _eq(got[k], pieces[k], f"all_gather uneven on {group}, piece from rank {j}")

    # all_to_all: the piece from rank i to rank j has shape (i + j, 2)
    def piece(i: int, j: int) -> torch.Tensor:
        return _t(100 * i + j, i + j, 2)

    for group in [WORLD, (1, 3, 0, 2), (3, 1)]:
        if r in group:
            got = comm.all_to_all([piece(r, j) for j in group], group,
                                  shapes=[(j + r, 2) for j in group])
            for k, j in enumerate(group):
                _eq(got[k], piece(j, r), f"all_to_all on {group}, piece from rank {j}")

    # reduce_scatter with uneven pieces: pieces[k] has shape (k + 1, 2)
    for group in [WORLD, (3, 1), (2, 0, 3)]:
        if r not in group:
            continue
        i = group.index(r)
        for op in ("sum", "max", "min"):
            def mine(m: int) -> list[torch.Tensor]:
                return [_t(1000 * m + k, k + 1, 2) for k in range(len(group))]
            got = comm.reduce_scatter(mine(r), group, op)
            _eq(got, _REDUCE[op]([mine(m)[i] for m in group]), f"reduce_scatter {op} on {group}")

    # all_reduce: out of place; max / min exact, sum to float tolerance (gloo's order)
    for group in [WORLD, (2, 0, 3)]:
        if r not in group:
            continue
        for op in ("sum", "max", "min"):
            x = _t(7 * r + 1, 5, 3)
            before = x.clone()
            got = comm.all_reduce(x, group, op)
            _eq(x, before, f"all_reduce {op} modified its input")
            expected = _REDUCE[op]([_t(7 * m + 1, 5, 3) for m in group])
            if op == "sum":
                assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6), (got, expected)
                out[f"all_reduce_sum{group}"] = got
            else:
                _eq(got, expected, f"all_reduce {op} on {group}")
        got = comm.all_reduce(torch.full((), float(r)), group, "max")
        _eq(got, torch.tensor(float(max(group))), "all_reduce of a 0-d tensor")

    # broadcast (float, int64, empty), on the world and a subgroup with a non-first source
    for group, src in [(WORLD, 2), ((3, 1), 3)]:
        if r in group:
            for shape, dtype in [((4, 2), torch.float32), ((3,), torch.int64),
                                 ((0, 5), torch.float32)]:
                x = _t(50 + src, *shape, dtype=dtype) if r == src else \
                    torch.zeros(shape, dtype=dtype)
                got = comm.broadcast(x, src, group)
                _eq(got, _t(50 + src, *shape, dtype=dtype), f"broadcast from {src} on {group}")

    # exchange: a ring, two ordered messages 0 -> 1, a message to self, an empty message
    sends = [((r + 1) % P, _t(300 + r, 3, r + 1))]
    recvs = [((r - 1) % P, (3, (r - 1) % P + 1), torch.float32)]
    sends.append((r, _t(400 + r, 2)))
    recvs.append((r, (2,), torch.float32))
    if r == 0:
        sends += [(1, _t(500, 4)), (1, _t(501, 2, 2, dtype=torch.int64)), (1, torch.empty(0))]
    if r == 1:
        recvs += [(0, (4,), torch.float32), (0, (2, 2), torch.int64), (0, (0,), torch.float32)]
    got = comm.exchange(sends, recvs)
    _eq(got[0], _t(300 + (r - 1) % P, 3, (r - 1) % P + 1), "exchange ring")
    _eq(got[1], _t(400 + r, 2), "exchange to self")
    if r == 1:
        _eq(got[2], _t(500, 4), "exchange, first of two 0 -> 1")
        _eq(got[3], _t(501, 2, 2, dtype=torch.int64), "exchange, second of two 0 -> 1")
        _eq(got[4], torch.empty(0), "exchange, empty message")
    if r in (0, 1):  # send / recv
        if r == 0:
            comm.send(_t(600, 3), 1)
        else:
            _eq(comm.recv((3,), torch.float32, 0), _t(600, 3), "send / recv")
    # one message an exchange (the backend's single send / recv path): other dtypes, a 0-d
    # tensor, a non-contiguous source, in order after one another
    singles = [_t(610, 2, 3, dtype=torch.int64), torch.tensor(2.5), _t(620, 4, 3).t(),
               torch.tensor([True, False, True])]
    for i, x in enumerate(singles):
        if r == 2:
            assert comm.exchange([(3, x)], []) == []
        elif r == 3:
            got = comm.exchange([], [(2, tuple(x.shape), x.dtype)])
            _eq(got[0], x, f"one-message exchange {i}")

    # message channels (sockets between the processes): a ring of posts, in order
    for k in range(30):
        comm.post((r + 1) % P, "ring", (k, _t(700 + k, 3)))
    got: list = []
    deadline = time.monotonic() + 20
    while len(got) < 30 and time.monotonic() < deadline:
        got += comm.inbox("ring", 0.5)
    assert comm._chan().transport == "socket", comm._chan().transport
    assert [(s, m[0]) for s, m in got] == [((r - 1) % P, k) for k in range(30)], got
    for k, (_, m) in enumerate(got):
        _eq(m[1], _t(700 + k, 3), f"post #{k} from rank {(r - 1) % P}")

    comm.barrier()
    if r in (3, 1):
        comm.barrier((3, 1))
    out["subgroups"] = sorted(k[0] for k in comm._groups)

    # byte counters equal base.py's formulas
    comm.reset_stats()
    un = [_t(j, j + 1, 4) for j in WORLD]  # 16 (j + 1) bytes on rank j
    comm.all_gather(un[r], WORLD, shapes=[tuple(u.shape) for u in un])
    pieces = [_t(j, r + j, 2, dtype=torch.float64) for j in WORLD]
    comm.all_to_all(pieces, WORLD, shapes=[(j + r, 2) for j in WORLD])
    rs = [_t(j, j + 2) for j in WORLD]
    comm.reduce_scatter(rs, WORLD, "sum")
    comm.all_reduce(_t(0, 10), WORLD)  # 10 floats in chunks 3, 3, 2, 2
    comm.broadcast(_t(0, 6), 1, WORLD)
    comm.exchange([((r + 1) % P, _t(0, r + 1))], [((r - 1) % P, ((r - 1) % P + 1,), torch.float32)])
    chunk = [3, 3, 2, 2][r] * 4
    expected = {
        "all_gather": ((P - 1) * _nb(un[r]), sum(_nb(u) for u in un) - _nb(un[r])),
        "all_to_all": (sum(_nb(p) for j, p in enumerate(pieces) if j != r),
                       sum((j + r) * 2 * 8 for j in WORLD if j != r)),
        "reduce_scatter": (sum(_nb(p) for j, p in enumerate(rs) if j != r), (P - 1) * _nb(rs[r])),
        "all_reduce": (40 - chunk + (P - 1) * chunk,) * 2,
        "broadcast": ((P - 1) * 24, 0) if r == 1 else (0, 24),
        "p2p": (4 * (r + 1), 4 * ((r - 1) % P + 1)),
    }
    st = comm.stats()
    for kind, (sent, recv) in expected.items():
        assert (st[kind].sent, st[kind].recv, st[kind].calls) == (sent, recv, 1), \
            f"{kind}: stats {st[kind]} != expected sent={sent} recv={recv}"
    out["sent"], out["recv"] = st.sent, st.recv

    # rank 0 leaves early; the others still use a new subgroup afterwards
    if r != 0:
        time.sleep(0.3)
        got = comm.all_reduce(torch.tensor([float(r)]), (3, 2, 1), "sum")
        _eq(got, torch.tensor([6.0]), "subgroup collective after rank 0 returned")
    return out


def fail_fn() -> None:
    comm = current()
    if comm.rank == 2:
        raise ValueError("boom on rank 2")
    if comm.rank == 3:
        time.sleep(600)  # blocked outside any collective: only the parent can stop it
    comm.barrier()  # ranks 0, 1 wait here for rank 2, which never comes


def crash_fn() -> None:
    if current().rank == 1:
        os._exit(7)
    current().barrier()


class _Unpicklable(Exception):
    def __init__(self, a: int, b: int) -> None:  # pickles, but cannot be unpickled
        super().__init__(f"{a}-{b}")


def unpicklable_exc_fn() -> None:
    if current().rank == 0:
        raise _Unpicklable(1, 2)
    current().barrier()


def sleep_fn() -> None:
    time.sleep(120)


def timeout_fn() -> None:
    comm = current()
    if comm.rank == 1:
        time.sleep(60)  # never joins: the others' collectives time out
    if comm.rank == 2:
        comm.all_reduce(torch.ones(2), (2, 1))  # a new subgroup: its rendezvous times out
    else:
        comm.all_gather(torch.ones(2), (0, 1, 2), shapes=[(2,)] * 3)


def skip_collective_fn() -> None:
    """3 ranks: all do all_reduce #1 of the world; rank 2 then sleeps while ranks 0 and 1 start
    all_reduce #2, which times out: they must name rank 2, idle since #1."""
    comm = current()
    comm.all_reduce(torch.ones(2), (0, 1, 2))
    if comm.rank == 2:
        time.sleep(60)  # the parent stops it
    comm.all_reduce(torch.ones(2), (2, 0, 1))


def mismatch_fn() -> None:
    """3 ranks, mismatched calls: ranks 0 and 1 wait in a world barrier (#1); rank 2 waits in
    the creation of subgroup (1, 2), which rank 1 never joins."""
    comm = current()
    if comm.rank == 2:
        time.sleep(1.0)  # ranks 0 and 1 should time out first (the test accepts either)
        comm.all_reduce(torch.ones(2), (2, 1))
    else:
        comm.barrier()


def p2p_timeout_fn() -> None:
    """2 ranks: after a barrier, rank 0 waits for a message rank 1 never sends (it sleeps)."""
    comm = current()
    comm.barrier()
    if comm.rank == 1:
        time.sleep(60)  # the parent stops it
    comm.recv((2,), torch.float32, 1)


def async_progress_fn() -> dict:
    """2 ranks: this rank's progress record of the world group (collective numbers counted
    from the first all-reduce here; the open ones, each marked waited for or not) after each
    step: an all-reduce started, a synchronous one meanwhile, the first waited for, one
    dropped unwaited; and the values all-reduced."""
    from sbpflow.comm.progress import group_key
    comm = current()
    key = group_key(range(comm.world_size))

    def record(first: int = 0) -> tuple[int, dict[int, bool]]:
        comm.progress.publish()
        g = comm.progress.read([comm.rank])[comm.rank]["groups"][key]
        return g["n"] - first, {int(s) - first: e[2] for s, e in g["open"].items()}

    x = torch.tensor([float(comm.rank + 1)])
    comm.all_reduce(x, (0, 1))
    first, out = record()[0], {}
    pending = comm.all_reduce_start(x, (0, 1))
    out["started"] = record(first)
    out["sync"] = comm.all_reduce(x * 10, (0, 1)).item()
    out["after_sync"] = record(first)
    out["async"] = pending.wait().item()
    out["waited"] = record(first)
    dropped = comm.all_reduce_start(x * 100, (0, 1))
    del dropped  # never waited for
    out["dropped"] = record(first)
    out["next"] = comm.all_reduce(x * 1000, (0, 1)).item()
    return out
