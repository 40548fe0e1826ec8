"""Loading in worker processes (``DataLoader(workers=k)``): the samples are read, stacked and
cut outside the rank's interpreter, so the dataset's Python does not compete with the rank's
for its GIL (torch's ``num_workers``).

`WorkerPool` forks ``k`` processes per (loader, rank) once and keeps them from epoch to epoch.
`WorkerPool.feed` starts an epoch: batch ``b`` goes to worker ``b % k``, which loads it only
once the consumer has granted it, so at most ``budget`` batches are loaded ahead of `Feed.get`.
The hot path has no pickle: a grant is a 20-byte pipe write; the worker writes the batch's
shards into a shared-memory slot (a file made before the fork) and answers with a fixed
header; the consumer copies the slot out. Workers run as SCHED_BATCH (`_batch_policy`). An
error travels as its class, message and (when it pickles) cause. A worker ends when its pool
is closed or garbage, when its rank's process ends, or when its parent is gone. A feed whose
pool went on to a later feed or was closed answers `STALE`; a closed pool's descriptors are
never used again (docs/runtime.md).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import select
import signal
import struct
import tempfile
import threading
import time
import weakref
from typing import Callable, NamedTuple

import numpy as np
import torch

from ..errors import DataLoaderError, SbpError
from .collate import ItemForm, Shards

__all__ = ["WorkerPool", "Feed", "STALE"]

_POLL = 0.05  # s between a waiting consumer's looks at its workers
_ALIGN = 64  # each shard starts at a multiple of this in its slot
# consumer -> worker: (kind, generation, value); kinds: an epoch starts, a batch is granted
_GRANT = struct.Struct("<iqq")
_EPOCH, _SLOT, _STOP = 0, 1, 2
# fds of this process's live pools: a newly forked worker closes those not its own (a worker
# holding another pool's pipe ends would keep that pool's worker from seeing its end)
_OPEN: set[int] = set()
_OPEN_LOCK = threading.Lock()
# worker -> consumer: (generation, batch, status, slot, extra bytes that follow)
_REPLY = struct.Struct("<qqiiq")
_SAME, _NEW_LAYOUT, _FAILED = 0, 1, 2
# `Feed.get`'s answer when the batch will not come: the pool started a later feed (another
# iteration of the same loader on this rank) or was closed. No error for the user: the loader
# loads the rest of the epoch itself
STALE = object()


class _Layout(NamedTuple):
    """Where a batch's shards lie in a slot: per shard (dtype, shape, offset, bytes); the bytes
    the slot must hold; the items' structure (`ItemForm`); the logical shapes."""

    fields: tuple
    nbytes: int
    form: ItemForm
    shapes: tuple


def _layout(shards: Shards) -> _Layout:
    fields, at, end = [], 0, 0
    for t in shards.locals:
        n = t.numel() * t.element_size()
        fields.append((t.dtype, tuple(t.shape), at, n))
        end = at + n if n else end
        at += -(-n // _ALIGN) * _ALIGN
    return _Layout(tuple(fields), end, shards.form, shards.shapes)


def _shared_file() -> int:
    """An anonymous file for one slot (memfd; an unlinked temporary file elsewhere), made
    before the fork so that parent and worker share it without passing descriptors."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create("sbpflow-data-slot")
    fd, path = tempfile.mkstemp(prefix="sbpflow-data-slot-")
    os.unlink(path)
    return fd


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _raw(t: torch.Tensor):
    """A buffer of ``t``'s bytes that pwritev takes: its numpy array when the dtype has a
    numpy twin (one call, where a byte view is four: a quarter of the worker's cost of
    writing a batch), else a byte view (bfloat16 and the like)."""
    t = t.contiguous()
    try:
        return t.numpy()
    except TypeError:
        return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _store(job: Callable[[int], Shards], b: int, slot: int, last: list) -> tuple[int, bytes]:
    """Load batch ``b`` into the slot file ``slot`` (one pwritev; the file grows as needed):
    (status, extra bytes of the reply: the layout when it changed)."""
    shards = job(b)
    layout = _layout(shards)
    parts: list = []
    end = 0  # bytes the parts cover so far
    for t, (_, _, at, n) in zip(shards.locals, layout.fields):
        if n:
            if at > end:
                parts.append(bytes(at - end))
            parts.append(_raw(t))
            end = at + n
    if parts:
        os.pwritev(slot, parts, 0)
    if layout == last[0]:
        return _SAME, b""
    last[0] = layout
    return _NEW_LAYOUT, pickle.dumps(layout, protocol=pickle.HIGHEST_PROTOCOL)


def _failure(exc: BaseException) -> bytes:
    """A worker's error for the consumer, pickled: ``(class, message, pickled cause or b"")``.
    The class is kept for sbpflow's own errors (the loader's checks: `ShapeError`,
    `SplitAxisError`, `DataLoaderError`, ..., raised as with the loading thread), else
    `DataLoaderError` with the exception's type in the message. The cause is the original
    exception (a failing ``__getitem__``'s own, which the loader wrapped; pickle keeps no
    ``__cause__``, so it travels by itself); b"" when it does not pickle."""
    ours = isinstance(exc, SbpError)
    cause = exc.__cause__ if ours and exc.__cause__ is not None else (None if ours else exc)
    try:
        blob = b"" if cause is None else pickle.dumps(cause, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - an unpicklable exception travels as its message only
        blob = b""
    message = str(exc) if ours else f"{type(exc).__name__}: {exc}"
    return pickle.dumps((type(exc) if ours else DataLoaderError, message, blob),
                        protocol=pickle.HIGHEST_PROTOCOL)


def _failed(extra: bytes) -> tuple[type, str, BaseException | None]:
    """`_failure`'s ``(class, message, cause or None)`` on the consumer (no cause when it did
    not pickle or does not unpickle, e.g. a class whose constructor takes other arguments)."""
    cls, message, blob = pickle.loads(extra)
    try:
        cause = pickle.loads(blob) if blob else None
    except Exception:  # noqa: BLE001 - the message still names the error
        cause = None
    return cls, message, cause if isinstance(cause, BaseException) else None


def _batch_policy() -> None:
    """Schedule this worker as SCHED_BATCH (Linux; same share of the CPU as before, no
    privilege needed): a woken batch task does not preempt the running one. A grant is a pipe
    write, and Linux runs the woken reader on the writer's core when the other is busy: as a
    normal task the worker then preempted the rank thread that had just granted, for the
    whole batch it loads (benchmarks/loader.py, loaded machine: the grant's write took 341 us
    of wall time on average, 1.2 ms at the 90th percentile; 78 us and 24 us as SCHED_BATCH)."""
    if hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_BATCH"):
        try:
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        except OSError:  # a sandbox refusing it: the normal policy still loads
            pass


def _serve(grants: int, out: int, fds: list[int], k: int,
           make_job: Callable[[int], Callable[[int], Shards]], parent: int) -> None:
    """A worker's loop: an epoch record switches to that epoch's batches, a grant of batch b
    (of the current generation) loads it into slot ``(b // k) % len(fds)``; the grants pipe's
    end (the pool closed, the parent gone) ends it."""
    for fd in _OPEN - {grants, out, *fds}:
        try:
            os.close(fd)
        except OSError:
            pass
    _batch_policy()
    # as torch's DataLoader workers: a forked child's first parallel kernel may wait for the
    # parent's intra-op threads, which the fork did not copy
    torch.set_num_threads(1)
    job, gen, pending, last = None, None, b"", [None]
    while True:
        try:
            if not select.select([grants], [], [], _POLL * 10)[0]:
                if os.getppid() != parent:
                    return
                continue
            chunk = os.read(grants, 1 << 16)
        except OSError:
            return
        if not chunk:
            return
        pending += chunk
        usable = len(pending) - len(pending) % _GRANT.size
        records, pending = list(_GRANT.iter_unpack(pending[:usable])), pending[usable:]
        for kind, g, value in records:
            if kind == _STOP:
                return
            if kind == _EPOCH:
                gen, job = g, make_job(value)
            elif kind == _SLOT and g == gen:
                j = (value // k) % len(fds)
                try:
                    status, extra = _store(job, value, fds[j], last)
                except BaseException as exc:  # noqa: BLE001 - handed to the consumer
                    status, extra = _FAILED, _failure(exc)
                try:
                    _write_all(out, _REPLY.pack(gen, value, status, j, len(extra)) + extra)
                except OSError:  # the consumer's end is closed
                    return


def _close(grants: list, replies: list, fds: list, procs: list) -> None:
    for fd in grants:
        try:
            os.write(fd, _GRANT.pack(_STOP, 0, 0))
        except OSError:
            pass
    with _OPEN_LOCK:
        _OPEN.difference_update(grants + replies + fds)
    for fd in grants + replies + fds:  # a closed grants pipe also ends its worker
        try:
            os.close(fd)
        except OSError:
            pass
    for p in procs:
        p.join(0.5)
        if p.is_alive():
            p.terminate()


_REAP = 2.0  # s to wait for a worker whose pipe has closed to be reaped (its exit code)


def _ended(proc: multiprocessing.process.BaseProcess) -> str:
    """How worker ``proc`` ended, for an error message: ``ended with exit code N`` or ``was
    killed by signal N (SIGNAME)``. A worker's pipe closes as it dies, before the kernel has
    made it a zombie that can be reaped: its exit code is read after a join of at most
    `_REAP` s (a worker still not reaped by then is named as such, never ``exit code None``)."""
    proc.join(_REAP)
    code = proc.exitcode
    if code is None:
        return f"closed its pipe but was still running {_REAP:g} s later"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "an unknown signal"
        return f"was killed by signal {-code} ({name})"
    return f"ended with exit code {code}"


class WorkerPool:
    """``k`` forked processes loading batches with ``make_job(epoch)`` (a function of the batch
    index), each with ``ceil(budget / k)`` shared-memory slots (enough for ``budget`` batches
    loaded ahead); ``name`` names them in messages; ``tag`` is its owner's (the loader keeps
    there the dataset's length at the fork, which the workers' copy keeps).

    Every use of the pipes and slots holds ``lock`` and checks ``closed`` first: after
    `close` (from any thread) their descriptors are closed and their numbers free for reuse,
    and a use would read or write whatever file took them (a closed pool sends nothing and
    receives nothing)."""

    def __init__(self, k: int, make_job: Callable[[int], Callable[[int], Shards]],
                 name: str, budget: int = 1, tag: object = None) -> None:
        ctx = multiprocessing.get_context("fork")
        self.name, self.k, self.gen, self.tag, self.closed = name, k, 0, tag, False
        self.budget = max(1, budget)
        per_worker = -(-self.budget // k)
        self.grants, self.replies, self.procs, self.slots = [], [], [], []
        self.buffers: list[bytearray] = []
        self.layouts: list[_Layout | None] = [None] * k
        self.makers: list[tuple] = [()] * k  # `_makers` of each worker's layout
        for i in range(k):
            fds = [_shared_file() for _ in range(per_worker)]
            grant_r, grant_w = os.pipe()
            reply_r, reply_w = os.pipe()
            p = ctx.Process(target=_serve, args=(grant_r, reply_w, fds, k, make_job,
                                                 os.getpid()),
                            name=f"{name}-worker{i}", daemon=True)
            with _OPEN_LOCK:  # held across the fork: the child's copy of _OPEN is complete
                _OPEN.update((grant_w, reply_r, *fds))  # the child keeps its own ends only
                p.start()
            os.close(grant_r)
            os.close(reply_w)
            os.set_blocking(reply_r, False)
            self.grants.append(grant_w)
            self.replies.append(reply_r)
            self.slots.append(fds)
            self.buffers.append(bytearray())
            self.procs.append(p)
        self.lock = threading.RLock()  # `feed` holds it across its grants (`send`)
        self._close = weakref.finalize(self, _close, self.grants, self.replies,
                                       [fd for fds in self.slots for fd in fds], self.procs)

    def send(self, i: int, kind: int, gen: int, value: int) -> None:
        """A grant to worker ``i`` (`DataLoaderError` naming it if it has ended; nothing once
        the pool is closed: its feeds are stale)."""
        try:
            with self.lock:
                if self.closed:
                    return
                os.write(self.grants[i], _GRANT.pack(kind, gen, value))  # 20 bytes: atomic
        except OSError as exc:  # BrokenPipeError: the worker's end is closed, it died
            proc = self.procs[i]
            what = f"batch {value}" if kind == _SLOT else f"epoch {value}"
            raise DataLoaderError(f"DataLoader: worker process {proc.name} (pid {proc.pid}) "
                                  f"{_ended(proc)} before it was given {what} "
                                  f"({type(exc).__name__})") from None

    def receive(self, i: int, wait: float, gen: int) -> list[tuple] | None:
        """The replies worker ``i`` has sent, ``(gen, b, ok, Shards or message)`` each:
        those already read, else what its pipe holds (waiting at most ``wait`` s when it
        holds nothing); ``None``: its end is closed. ``[]`` when generation ``gen`` (the
        caller's feed) is no longer the pool's, or the pool is closed: a stale feed must not
        take the current feed's replies."""
        with self.lock:  # a wait holds it at most ``wait`` s (`close` from another thread)
            return [] if self.closed or gen != self.gen else self._receive(i, wait)

    def _receive(self, i: int, wait: float) -> list[tuple] | None:
        out = self._frames(i) if self.buffers[i] else None  # usually empty: no parse
        if out:
            return out
        fd = self.replies[i]
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            select.select([fd], [], [], wait)
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                return []
        if not chunk:
            return None
        self.buffers[i] += chunk
        return self._frames(i)

    def _frames(self, i: int) -> list[tuple]:
        """The whole replies at the head of worker ``i``'s buffer (removed from it); layouts
        are applied whatever the generation (the worker sends each change once)."""
        buf, out, at = self.buffers[i], [], 0
        while len(buf) - at >= _REPLY.size:
            gen, b, status, j, n = _REPLY.unpack_from(buf, at)
            if len(buf) - at - _REPLY.size < n:
                break
            extra = bytes(buf[at + _REPLY.size:at + _REPLY.size + n]) if n else b""
            at += _REPLY.size + n
            if status == _FAILED:
                out.append((gen, b, False, _failed(extra)))
                continue
            if status == _NEW_LAYOUT:
                self.layouts[i] = pickle.loads(extra)
                self.makers[i] = _makers(self.layouts[i])
            # copied at once (the slot is then free); an abandoned epoch's batch is not
            out.append((gen, b, True, self._copy_out(i, j) if gen == self.gen else None))
        del buf[:at]
        return out

    def _copy_out(self, i: int, j: int) -> Shards:
        """Slot ``j`` of worker ``i`` as a batch the caller owns: one pread of the slot's bytes
        (no mapping: Python's mmap holds a duplicate of the file's descriptor, which later
        forks would inherit), then a view a shard (`_makers`: worked out once a layout)."""
        layout = self.layouts[i]
        data = bytearray(layout.nbytes)
        if layout.nbytes and os.preadv(self.slots[i][j], [data], 0) != layout.nbytes:
            raise DataLoaderError(f"DataLoader: worker process {self.procs[i].name}'s slot "
                                  f"{j} holds fewer than the {layout.nbytes} bytes announced")
        return Shards(layout.form, tuple(_tensor(data, *f) for f in self.makers[i]),
                      layout.shapes)

    def feed(self, epoch: int, count: int, budget: int, timeout: float) -> "Feed":
        """Start loading ``count`` batches of ``epoch`` (any earlier feed is abandoned: its
        `Feed.get` answers `STALE`; so does this one's if the pool is closed)."""
        with self.lock:
            self.gen += 1
            for i in range(self.k):
                self.send(i, _EPOCH, self.gen, epoch)
            return Feed(self, self.gen, count, min(max(1, budget), self.budget), timeout)

    def close(self) -> None:
        """End the workers and close the descriptors; the pool's feeds are stale from now."""
        with self.lock:
            self.closed = True
        self._close()


_NUMPY: dict = {}  # torch dtype -> numpy dtype or None


def _makers(layout: _Layout) -> tuple:
    """Per shard of ``layout``: what `_tensor` needs, worked out once a layout (the consumer
    makes the tensors of every batch from it): (torch dtype, numpy twin or None, shape,
    offset, elements)."""
    out = []
    for dtype, shape, at, n in layout.fields:
        twin = _NUMPY.get(dtype, False)
        if twin is False:
            try:
                twin = _NUMPY[dtype] = torch.empty(0, dtype=dtype).numpy().dtype
            except TypeError:  # bfloat16 and the like: no numpy dtype
                twin = _NUMPY[dtype] = None
        out.append((dtype, twin, shape, at, n // dtype.itemsize))
    return tuple(out)


def _tensor(data: bytearray, dtype: torch.dtype, twin, shape: tuple, at: int,
            count: int) -> torch.Tensor:
    """The tensor of ``count`` elements at byte ``at`` of ``data`` (sharing them). Through
    numpy when the dtype has a numpy ``twin``: half the cost of torch.frombuffer + view."""
    if not count:
        return torch.empty(shape, dtype=dtype)
    if twin is None:
        return torch.frombuffer(data, dtype=dtype, count=count, offset=at).view(shape)
    return torch.from_numpy(np.frombuffer(data, twin, count, at).reshape(shape))


class Feed:
    """One epoch's batches from a `WorkerPool`, in order, at most ``budget`` loaded ahead."""

    def __init__(self, pool: WorkerPool, gen: int, count: int, budget: int,
                 timeout: float) -> None:
        self.pool, self.gen, self.count, self.timeout = pool, gen, count, timeout
        self.granted = 0
        self.got: dict[int, tuple] = {}
        for _ in range(min(budget, count)):
            self._grant()

    @property
    def stale(self) -> bool:
        """A later feed of the pool has started, or the pool was closed: this one's batches
        (beyond those already copied out) will not come."""
        return self.gen != self.pool.gen or self.pool.closed

    def _grant(self) -> None:
        b = self.granted
        self.pool.send(b % self.pool.k, _SLOT, self.gen, b)
        self.granted += 1

    def get(self, b: int) -> Shards:
        """Batch ``b`` (the next one); grants the next batch to its worker (its slot is free:
        batch ``b`` was copied out of its own). `STALE` when the batch will not come (the
        pool went on to a later feed or was closed): never a wait for it."""
        i = b % self.pool.k
        got = self.got.pop(b, None)
        deadline = None
        while got is None:
            replies = self.pool.receive(i, _POLL, self.gen)
            for gen, g, ok, value in replies or ():
                if gen == self.gen and (value is not None or not ok):  # None: not copied
                    self.got[g] = (ok, value)
            got = self.got.pop(b, None)
            if got is not None:
                break
            if self.stale:  # checked after the receive: a close meanwhile ends the workers
                return STALE
            proc = self.pool.procs[i]
            if replies is None or not proc.is_alive():
                raise DataLoaderError(f"DataLoader: worker process {proc.name} (pid {proc.pid}) "
                                      f"{_ended(proc)} without batch {b}")
            deadline = deadline or time.monotonic() + self.timeout
            if time.monotonic() > deadline:
                raise DataLoaderError(f"DataLoader: waited {self.timeout:g} s for batch {b} "
                                      f"from worker process {proc.name} (pid {proc.pid}) "
                                      f"(SBPFLOW_TIMEOUT or DataLoader(timeout=))")
        ok, value = got
        if not ok:
            cls, message, cause = value
            raise cls(f"DataLoader: worker process {self.pool.procs[i].name}: {message}") \
                from cause
        if self.granted < self.count and not self.stale:
            self._grant()
        return value
