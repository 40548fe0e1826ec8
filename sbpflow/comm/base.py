"""The Communicator protocol and its byte counters.

A `Communicator` is one rank's handle on the world. Every collective runs over a *group*: a
tuple of global ranks, in the order that defines piece indices (``pieces[i]`` goes to
``group[i]``). Uneven piece sizes are allowed everywhere. Callers that know the shapes of what
they will receive pass them (``shapes=``), so no backend needs a size exchange.

Byte accounting is defined here, once, for every backend, by the rules of the collective kinds
table (`sbpflow.comm.kinds`: the bytes a bandwidth-optimal algorithm moves, uneven pieces
included), the same rules the boxing planner charges and the cost model prices.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ..errors import CommError
from ..sbp import REDUCE_OPS
from .channels import tensor_bytes
from .kinds import (broadcast_traffic, exchange_traffic, gather_traffic, ring_traffic,
                    scatter_traffic)
from .progress import Activity, Finding
from .per_rank import PerRankState

__all__ = ["Communicator", "CommStats", "KindStats", "REDUCE_OPS", "Assemble", "reduce_tensors",
           "nbytes", "Pending", "default_timeout", "counted_as"]

Assemble = Callable[[list], object]  # receives the pieces (valid only during the call)


class _CountedAs(threading.local):
    kind: str | None = None


_COUNTED_AS = _CountedAs()


@contextlib.contextmanager
def counted_as(kind: str):
    """Count the bytes of every collective this thread runs inside as ``kind`` (e.g. the
    replicated fallback's gathers, "fallback"), whatever their own kind."""
    before, _COUNTED_AS.kind = _COUNTED_AS.kind, kind
    try:
        yield
    finally:
        _COUNTED_AS.kind = before

_REDUCERS = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}


def default_timeout() -> float:
    """Seconds a collective may wait: ``SBPFLOW_TIMEOUT`` (default 300)."""
    return float(os.environ.get("SBPFLOW_TIMEOUT", "300"))


class _CollectiveStream(threading.local):
    name: str | None = None


_stream = _CollectiveStream()


def collective_stream() -> str | None:
    """The calling thread's collective stream (None: the default one)."""
    return _stream.name


def set_collective_stream(name: str | None) -> str | None:
    """Make the calling thread's collectives pair only with the same stream's on the other
    ranks, in that stream's own order (an actor's collectives on each rank of a stage pair up
    whichever order the rank's actors fire in). Returns the previous stream."""
    previous, _stream.name = _stream.name, name
    return previous


def reduce_tensors(tensors: Sequence[torch.Tensor], op: str) -> torch.Tensor:
    """Reduce ``tensors`` in the given order into a new tensor (same order on every rank, so
    every rank computes bit-identical results)."""
    fn = _REDUCERS[op]
    out = tensors[0].clone() if len(tensors) == 1 else fn(tensors[0], tensors[1])
    for t in tensors[2:]:
        out = fn(out, t, out=out)
    return out


_CPU = torch.device("cpu")


def _device(d: torch.device | str) -> torch.device:
    """``d`` as a `torch.device` (a device is returned as it is: no new object a message)."""
    return d if isinstance(d, torch.device) else torch.device(d)


def nbytes(t: torch.Tensor | tuple, dtype: torch.dtype | None = None) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    numel = 1
    for s in t:
        numel *= int(s)
    return numel * dtype.itemsize


def _clone_all(pieces: list) -> list:
    return [p.clone() for p in pieces]


@dataclass
class KindStats:
    sent: int = 0
    recv: int = 0
    calls: int = 0


@dataclass
class CommStats:
    """Bytes sent and received by one rank, per kind of communication, since the last reset."""

    rank: int
    kinds: dict = field(default_factory=dict)

    @property
    def sent(self) -> int:
        """Bytes sent, all kinds together."""
        return sum(k.sent for k in self.kinds.values())

    @property
    def recv(self) -> int:
        """Bytes received, all kinds together."""
        return sum(k.recv for k in self.kinds.values())

    def __getitem__(self, kind: str) -> KindStats:
        return self.kinds.get(kind, KindStats())

    def copy(self) -> "CommStats":
        """An independent copy of the counters."""
        return CommStats(self.rank, {k: KindStats(v.sent, v.recv, v.calls)
                                     for k, v in self.kinds.items()})

    def __repr__(self) -> str:
        body = ", ".join(f"{k}: sent={v.sent} recv={v.recv} calls={v.calls}"
                         for k, v in sorted(self.kinds.items()))
        return f"CommStats(rank={self.rank}, sent={self.sent}, recv={self.recv}; {body})"


class Pending:
    """A collective that has been started: ``wait()`` blocks until it is done and returns its
    result (the same object on every later call)."""

    __slots__ = ("_finish", "_result")

    def __init__(self, finish: Callable[[], torch.Tensor]) -> None:
        self._finish, self._result = finish, None

    @classmethod
    def done(cls, result: torch.Tensor) -> "Pending":
        p = cls(None)
        p._result = result
        return p

    def wait(self) -> torch.Tensor:
        if self._finish is not None:
            finish, self._finish = self._finish, None
            self._result = finish()
        return self._result


class Communicator:
    """One rank's communication with the others. Subclasses implement the ``_`` methods.

    Public methods validate, count bytes, skip single-member groups, then call the backend.
    They block and return new tensors (never views of another rank's memory), except the
    ``*_start`` forms, which return a `Pending` (a backend without asynchronous collectives
    completes the work before returning it).
    """

    backend: str = "abstract"
    # whether `interrupt` makes a waiting collective raise (a torch process group cannot
    # cancel a call): the runtime runs actors on the calling thread only then
    interruptible: bool = False

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self._stats = CommStats(rank)
        self._stats_lock = threading.Lock()
        self.per_rank = PerRankState()  # per-rank state of the layers above, by named field
        # what the rank does besides collectives (its actor runs, its last op), for timeouts
        self.activity = Activity()

    def wait_timeout(self) -> float:
        """Seconds a wait on this communicator may take: what its world was made with
        (``sf.launch(..., timeout=)``), else ``SBPFLOW_TIMEOUT``. The layers above bound their
        own waits (an actor's, a loader's, a timeline's exchange) by it."""
        return default_timeout()

    def whereabouts(self, ranks: Sequence[int], threshold: float) -> Finding:
        """After a wait of this rank timed out (an actor's): what each of ``ranks`` (this one
        included) is doing, and the culprits: those that wait for no other rank, for
        ``threshold`` s at least (inside an actor's own code, or outside sbpflow). The torch
        backend reads the ranks' progress records (a wait of 1.5 publication periods), the
        threads backend the world's state; a backend that knows nothing says nothing."""
        return Finding("")

    # -- accounting -------------------------------------------------------------------------
    def _count(self, kind: str, sent: int, recv: int, itemsize: int = 1) -> None:
        """Count one call of ``kind`` moving ``sent`` / ``recv`` items of ``itemsize`` bytes
        (under `counted_as`'s kind instead, inside one)."""
        kind = _COUNTED_AS.kind or kind
        sent, recv = sent * itemsize, recv * itemsize
        with self._stats_lock:
            k = self._stats.kinds.get(kind)
            if k is None:  # (not setdefault: that builds a KindStats every call)
                k = self._stats.kinds[kind] = KindStats()
            k.sent += sent
            k.recv += recv
            k.calls += 1

    def stats(self) -> CommStats:
        """A copy of this rank's byte counters since the last `reset_stats` (`CommStats`)."""
        with self._stats_lock:
            return self._stats.copy()

    def reset_stats(self) -> None:
        """Zero this rank's byte counters."""
        with self._stats_lock:
            self._stats = CommStats(self.rank)

    def _index(self, group: Sequence[int], kind: str) -> int:
        try:
            return list(group).index(self.rank)
        except ValueError:
            raise CommError(f"{kind}: rank {self.rank} is not in the group {tuple(group)}") from None

    # -- collectives --------------------------------------------------------------------------
    def all_gather(self, tensor: torch.Tensor, group: Sequence[int], shapes=None,
                   assemble: Assemble | None = None, count_as: str = "all_gather",
                   joined: tuple | None = None):
        """Every member gets every member's tensor. ``shapes[j]``: shape of member j's tensor.

        Returns ``assemble(pieces)`` (default: a list of copies, in group order). ``count_as``
        names the kind the bytes are counted under (e.g. "meta" for shape exchanges).
        ``joined``: the result's shape when the pieces laid back to back in group order are
        the result (a batch split); a backend that receives them so, into a buffer of its own,
        returns that buffer in this shape, without calling ``assemble`` (no copy).
        """
        group = tuple(group)
        i = self._index(group, "all_gather")
        assemble = assemble or _clone_all
        if len(group) == 1:
            return assemble([tensor])
        if shapes is None:
            shapes = self._exchange_shapes(tensor, group)
        sizes = [math.prod(s) for s in shapes]
        sizes[i] = tensor.numel()
        self._count(count_as, *gather_traffic(i, sizes), tensor.element_size())
        return self._all_gather(tensor, group, [tuple(s) for s in shapes], assemble, joined)

    def gather_ints(self, values: Sequence[int], group: Sequence[int]) -> list[list[int]]:
        """Every member's ``values`` (as many on each), in group order: the one all-gather of
        a check that the ranks agree (a digest and a few counts; counted as "meta")."""
        group = tuple(group)
        mine = torch.tensor(list(values), dtype=torch.int64)
        rows = self.all_gather(mine, group, [tuple(mine.shape)] * len(group), count_as="meta")
        return [r.tolist() for r in rows]

    def all_to_all(self, pieces: Sequence[torch.Tensor], group: Sequence[int], shapes=None,
                   assemble: Assemble | None = None, joined: tuple | None = None):
        """``pieces[j]`` goes to ``group[j]``; returns ``assemble(received)`` in group order.

        ``shapes[j]``: shape of the piece this rank receives from ``group[j]``. Pieces may be
        views of any strides. ``joined``: as for `all_gather`, of the received pieces.
        """
        group = tuple(group)
        i = self._index(group, "all_to_all")
        assemble = assemble or _clone_all
        if len(pieces) != len(group):
            raise ValueError(f"all_to_all: {len(pieces)} pieces for a group of {len(group)}")
        if len(group) == 1:
            return assemble(list(pieces))
        if shapes is None:
            shapes = self._exchange_a2a_shapes(pieces, group)
        shapes = [tuple(s) for s in shapes]
        t = exchange_traffic(i, [p.numel() for p in pieces], [math.prod(s) for s in shapes])
        self._count("all_to_all", *t, pieces[0].element_size())
        return self._all_to_all(list(pieces), group, shapes, assemble, joined)

    def reduce_scatter(self, pieces: Sequence[torch.Tensor], group: Sequence[int],
                       op: str = "sum") -> torch.Tensor:
        """Member j receives the ``op``-reduction over members of their ``pieces[j]`` (views
        of any strides)."""
        group = tuple(group)
        i = self._index(group, "reduce_scatter")
        if op not in REDUCE_OPS:
            raise ValueError(f"reduce op must be one of {REDUCE_OPS}, got {op!r}")
        if len(group) == 1:
            return pieces[0].clone()
        t = scatter_traffic(i, [p.numel() for p in pieces])
        self._count("reduce_scatter", *t, pieces[0].element_size())
        return self._reduce_scatter(list(pieces), group, op)

    def all_reduce(self, tensor: torch.Tensor, group: Sequence[int], op: str = "sum") -> torch.Tensor:
        """Every member gets the ``op``-reduction of all members' tensors (same shape)."""
        group = tuple(group)
        if self._count_all_reduce(tensor, group, op):
            return self._all_reduce(tensor, group, op)
        return tensor.clone()

    def all_reduce_start(self, tensor: torch.Tensor, group: Sequence[int], op: str = "sum", *,
                         inplace: bool = False) -> Pending:
        """`all_reduce` started without waiting: overlap it with other work, then ``wait()``.
        Members must start their collectives in the same order (as for blocking ones);
        ``tensor`` must not change until the wait. ``inplace=True`` lets the backend reduce
        into ``tensor`` itself (saving a copy) when it can: the result may then be ``tensor``."""
        group = tuple(group)
        if self._count_all_reduce(tensor, group, op):
            return self._all_reduce_start(tensor, group, op, inplace)
        return Pending.done(tensor if inplace else tensor.clone())

    def _count_all_reduce(self, tensor: torch.Tensor, group: tuple, op: str) -> bool:
        """Validate and count an all-reduce; False when the group is this rank alone."""
        i = self._index(group, "all_reduce")
        if op not in REDUCE_OPS:
            raise ValueError(f"reduce op must be one of {REDUCE_OPS}, got {op!r}")
        if len(group) == 1:
            return False
        self._count("all_reduce", *ring_traffic(i, len(group), tensor.numel()),
                    tensor.element_size())
        return True

    def broadcast(self, tensor: torch.Tensor, src: int, group: Sequence[int]) -> torch.Tensor:
        """Every member gets ``src``'s tensor; the others pass a tensor of the same shape/dtype."""
        group = tuple(group)
        i = self._index(group, "broadcast")
        if len(group) == 1:
            return tensor.clone()
        root = group.index(src) if src in group else -1
        t = broadcast_traffic(i, len(group), tensor.numel(), root)
        self._count("broadcast", *t, tensor.element_size())
        return self._broadcast(tensor, src, group)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Send ``tensor`` to rank ``dst`` (counted as ``p2p``); returns when it is handed over."""
        self._count("p2p", nbytes(tensor), 0)
        self._exchange([(dst, tensor)], [])

    def recv(self, shape: Sequence[int], dtype: torch.dtype, src: int,
             device: torch.device | str = "cpu") -> torch.Tensor:
        """Receive a tensor of ``shape`` and ``dtype`` from rank ``src`` (counted as ``p2p``)."""
        self._count("p2p", 0, nbytes(tuple(shape), dtype))
        return self._exchange([], [(src, tuple(shape), dtype, torch.device(device))])[0]

    def exchange(self, sends: Sequence[tuple[int, torch.Tensor]],
                 recvs: Sequence[tuple]) -> list[torch.Tensor]:
        """Batched point-to-point: ``sends`` are ``(dst, tensor)``, ``recvs`` are
        ``(src, shape, dtype[, device])``; messages between a pair arrive in order.
        Returns the received tensors in the order of ``recvs``. Never deadlocks on ordering."""
        recvs = [(r[0], tuple(r[1]), r[2], _device(r[3] if len(r) > 3 else _CPU))
                 for r in recvs]
        if sends or recvs:
            self._count("p2p", sum(nbytes(t) for _, t in sends),
                        sum(nbytes(s, d) for _, s, d, _ in recvs))
        return self._exchange(list(sends), recvs)

    def barrier(self, group: Sequence[int] | None = None) -> None:
        """Wait until every rank of ``group`` (default the world) has called it."""
        group = tuple(group) if group is not None else tuple(range(self.world_size))
        if len(group) > 1:
            self._barrier(group)

    # -- message channels (sbpflow.comm.channels): asynchronous, any sender ------------------
    def post(self, dst: int, channel: str, message: object) -> None:
        """Queue ``message`` for rank ``dst``'s ``channel`` and return at once. ``message`` is
        any picklable object; the tensors in it (counted as kind "message") are copied.
        Messages from one sender to one channel arrive in the order posted."""
        if not 0 <= dst < self.world_size:
            raise CommError(f"post on rank {self.rank}: destination rank {dst} is outside the "
                            f"world of {self.world_size}")
        self._count("message", tensor_bytes(message), 0)
        self._post(dst, channel, message)

    def inbox(self, channel: str, timeout: float) -> list[tuple[int, object]]:
        """The messages posted to this rank's ``channel`` since the last call, as ``(src,
        message)`` in arrival order; waits at most ``timeout`` s for the first (none: ``[]``)."""
        got = self._inbox(channel, timeout)
        if got:
            self._count("message", 0, sum(tensor_bytes(m) for _, m in got))
        return got

    def listen(self, channel: str, deliver: Callable[[list], None],
               failed: Callable[[BaseException], None]) -> bool:
        """Have ``deliver(messages)`` called with what arrives on ``channel`` (``(src,
        message)`` pairs, in `inbox`'s order, counted as it counts them) by the thread that
        receives it, instead of queueing it for `inbox`: one thread wake-up less a message.
        ``failed(exc)`` is called once if receiving fails. Returns False where the backend
        cannot (then nothing changed; read with `inbox`). ``deliver`` must not block."""
        return False

    @property
    def leads(self) -> bool:
        """Whether a thread can wait for messages on the transport itself (`lead`)."""
        return False

    def lead(self, timeout: float | None) -> bool:
        """Wait up to ``timeout`` s (None: until woken) for messages on the calling thread and
        hand over what arrives (to `listen`'s ``deliver`` or `inbox`) before returning, so
        the thread that waits for a message is the one the kernel wakes for it; `wake_leader`
        ends the wait. False at once (nothing waited) where another thread leads or the
        backend cannot."""
        return False

    def wake_leader(self) -> None:
        """End a `lead` wait under way now (a message of this process's own for the leader)."""

    def lead_end(self) -> None:
        """The thread that led waits no more for now: receive as before `lead` at once."""

    # -- shape exchange for callers that do not know them (counted as "meta") -----------------
    def _exchange_shapes(self, tensor: torch.Tensor, group: tuple) -> list[tuple]:
        dims = torch.tensor(list(tensor.shape), dtype=torch.int64)
        out = self.all_gather(dims, group, shapes=[dims.shape] * len(group), count_as="meta")
        return [tuple(int(v) for v in t) for t in out]

    def _exchange_a2a_shapes(self, pieces, group: tuple) -> list[tuple]:
        dims = [torch.tensor(list(p.shape), dtype=torch.int64) for p in pieces]
        out = self.all_to_all(dims, group, shapes=[dims[0].shape] * len(group))
        return [tuple(int(v) for v in t) for t in out]

    # -- backend hooks ------------------------------------------------------------------------
    def _all_gather(self, tensor, group, shapes, assemble, joined=None):
        raise NotImplementedError

    def _all_to_all(self, pieces, group, shapes, assemble, joined=None):
        raise NotImplementedError

    def _reduce_scatter(self, pieces, group, op):
        raise NotImplementedError

    def _all_reduce(self, tensor, group, op):
        raise NotImplementedError

    def _all_reduce_start(self, tensor, group, op, inplace=False) -> Pending:
        return Pending.done(self._all_reduce(tensor, group, op))

    def _broadcast(self, tensor, src, group):
        raise NotImplementedError

    def _exchange(self, sends, recvs):
        raise NotImplementedError

    def _barrier(self, group):
        raise NotImplementedError

    def _post(self, dst, channel, message):
        raise NotImplementedError

    def _inbox(self, channel, timeout):
        raise NotImplementedError

    def interrupt(self, reason: str) -> None:
        """Make this rank's collectives in a named stream (`set_collective_stream`) that are
        waiting now raise `CommAborted` with ``reason``: a failed run of a plan whose actors
        rename their streams after a failure abandons them. The threads backend does; a torch
        process group cannot cancel a call, which ends by its timeout."""

    def device(self, device_type: str) -> torch.device:
        """The torch device this rank uses for ``device_type`` placements."""
        raise NotImplementedError

    def close(self) -> None:
        """Release the backend's resources (sockets, threads); the communicator is not used
        after."""
        pass
