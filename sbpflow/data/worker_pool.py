"""Loading in worker processes (``DataLoader(workers=k)``): the samples are read, stacked and
cut outside the rank's interpreter, so the dataset's Python does not compete with the rank's
for its GIL (torch's ``num_workers``).

`WorkerPool` forks ``k`` processes per (loader, rank) once and keeps them from epoch to epoch.
`WorkerPool.feed` starts an epoch: batch ``b`` goes to worker ``b % k``, which loads it only
once the consumer has granted it (``("slot", generation, b)``), so at most ``budget`` batches
are loaded ahead of `Feed.get`. A batch travels as raw bytes a shard through a plain pipe the
consumer reads without blocking (no shared-memory handles; one read can take several
batches: system calls are the consumer's main cost); an error as its message
(`DataLoaderError`). A worker ends when its pool is closed or
garbage, when its rank's process ends, or when its parent is gone.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import select
import struct
import threading
import time
import weakref
from typing import Any, Callable

import torch

from ..errors import DataLoaderError
from .collate import Shards

__all__ = ["WorkerPool", "Feed"]

_POLL = 0.05  # s between a waiting consumer's looks at its workers


def _pack(shards: Shards) -> tuple:
    """Shards as (is_tuple, [(dtype name, shape, bytes)], shapes): plain bytes pickle with no
    shared-memory handle (torch's reductions would pass a file descriptor a tensor)."""
    out = []
    for t in shards.locals:
        t = t.contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        out.append((str(t.dtype).rsplit(".", 1)[1], tuple(t.shape), data))
    return shards.is_tuple, out, shards.shapes


def _unpack(packed: tuple) -> Shards:
    is_tuple, values, shapes = packed
    locals_ = []
    for dtype, shape, data in values:
        dt = getattr(torch, dtype)
        if data:
            t = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dt).reshape(shape)
        else:
            t = torch.empty(shape, dtype=dt)
        locals_.append(t)
    return Shards(is_tuple, tuple(locals_), shapes)


_HEADER = struct.Struct("<Q")


def _write(fd: int, reply: tuple) -> None:
    data = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def _serve(conn: Any, out: int, make_job: Callable[[int], Callable[[int], Shards]],
           parent: int) -> None:
    """A worker's loop: ``("epoch", generation, epoch)`` switches to an epoch's batches,
    ``("slot", generation, b)`` loads batch b of it, ``None`` (or a closed pipe, or a dead
    parent) ends it."""
    job, gen = None, None
    while True:
        try:
            if not conn.poll(_POLL * 10):
                if os.getppid() != parent:
                    return
                continue
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        if msg[0] == "epoch":
            gen, job = msg[1], make_job(msg[2])
        elif msg[0] == "slot" and msg[1] == gen:
            b = msg[2]
            try:
                reply = (gen, b, True, _pack(job(b)))
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer, raised there
                reply = (gen, b, False, f"{type(exc).__name__}: {exc}")
            try:
                _write(out, reply)
            except OSError:  # the consumer's end is closed
                return


def _frames(buf: bytearray) -> list[tuple]:
    """The whole messages at the head of ``buf`` (removed from it)."""
    out, at = [], 0
    while len(buf) - at >= _HEADER.size:
        (n,) = _HEADER.unpack_from(buf, at)
        if len(buf) - at - _HEADER.size < n:
            break
        out.append(pickle.loads(buf[at + _HEADER.size:at + _HEADER.size + n]))
        at += _HEADER.size + n
    del buf[:at]
    return out


def _close(conns: list, fds: list, procs: list) -> None:
    for c in conns:
        try:
            c.send(None)
            c.close()
        except (OSError, ValueError):
            pass
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    for p in procs:
        p.join(0.5)
        if p.is_alive():
            p.terminate()


class WorkerPool:
    """``k`` forked processes loading batches with ``make_job(epoch)`` (a function of the batch
    index); ``name`` names them in messages."""

    def __init__(self, k: int, make_job: Callable[[int], Callable[[int], Shards]],
                 name: str) -> None:
        ctx = multiprocessing.get_context("fork")
        self.name, self.k, self.gen = name, k, 0
        self.conns, self.fds, self.procs = [], [], []  # grants to, batches from, each worker
        self.buffers: list[bytearray] = []
        for i in range(k):
            theirs, mine = ctx.Pipe(duplex=False)
            rfd, wfd = os.pipe()
            p = ctx.Process(target=_serve, args=(theirs, wfd, make_job, os.getpid()),
                            name=f"{name}-worker{i}", daemon=True)
            p.start()
            theirs.close()
            os.close(wfd)
            os.set_blocking(rfd, False)
            self.conns.append(mine)
            self.fds.append(rfd)
            self.buffers.append(bytearray())
            self.procs.append(p)
        self.lock = threading.Lock()
        self._close = weakref.finalize(self, _close, self.conns, self.fds, self.procs)

    def receive(self, i: int, wait: float) -> list[tuple] | None:
        """The replies worker ``i`` has sent: those already read, else what its pipe holds
        (waiting at most ``wait`` s when it holds nothing); ``None``: its end is closed."""
        out = _frames(self.buffers[i])
        if out:
            return out
        fd = self.fds[i]
        try:
            chunk = os.read(fd, 1 << 22)
        except BlockingIOError:
            select.select([fd], [], [], wait)
            try:
                chunk = os.read(fd, 1 << 22)
            except BlockingIOError:
                return []
        if not chunk:
            return None
        self.buffers[i] += chunk
        return _frames(self.buffers[i])

    def feed(self, epoch: int, count: int, budget: int, timeout: float) -> "Feed":
        """Start loading ``count`` batches of ``epoch`` (any earlier feed is abandoned)."""
        with self.lock:
            self.gen += 1
            for c in self.conns:
                c.send(("epoch", self.gen, epoch))
        return Feed(self, self.gen, count, max(1, budget), timeout)

    def close(self) -> None:
        self._close()


class Feed:
    """One epoch's batches from a `WorkerPool`, in order, at most ``budget`` loaded ahead."""

    def __init__(self, pool: WorkerPool, gen: int, count: int, budget: int,
                 timeout: float) -> None:
        self.pool, self.gen, self.count, self.timeout = pool, gen, count, timeout
        self.granted = 0
        self.got: dict[int, tuple] = {}
        for _ in range(min(budget, count)):
            self._grant()

    def _grant(self) -> None:
        b = self.granted
        self.pool.conns[b % self.pool.k].send(("slot", self.gen, b))
        self.granted += 1

    def get(self, b: int) -> Shards:
        """Batch ``b`` (the next one); grants the next batch to its worker."""
        i = b % self.pool.k
        proc = self.pool.procs[i]
        deadline = time.monotonic() + self.timeout
        while b not in self.got:
            replies = self.pool.receive(i, _POLL)
            for gen, got, ok, value in replies or ():
                if gen == self.gen:
                    self.got[got] = (ok, value)
            if b in self.got:
                break
            if replies is None or not proc.is_alive():
                raise DataLoaderError(f"DataLoader: worker process {proc.name} (pid {proc.pid}) "
                                      f"ended (exit code {proc.exitcode}) without batch {b}")
            elif time.monotonic() > deadline:
                raise DataLoaderError(f"DataLoader: waited {self.timeout:g} s for batch {b} "
                                      f"from worker process {proc.name} (pid {proc.pid}) "
                                      f"(SBPFLOW_TIMEOUT or DataLoader(timeout=))")
        ok, value = self.got.pop(b)
        if not ok:
            raise DataLoaderError(f"DataLoader: worker process {proc.name}: {value}")
        if self.granted < self.count:
            self._grant()
        return _unpack(value)
