"""In-process backend: one thread a rank, rendezvous through shared memory.

A collective is a *slot* keyed by (group, sequence number). Each member deposits its input,
waits until every member has, computes its own result by reading the others' inputs (torch
kernels release the GIL, so ranks compute in parallel), then waits until every member has
finished reading before it returns — so no rank's result aliases memory another rank may change.

Nothing hangs: every wait wakes at least every ``_POLL`` seconds and raises `CommAborted` if
another rank failed, `CommError` if a missing rank has already returned from its function, and
`CommTimeout` (naming the collective and the missing ranks) after ``timeout`` seconds.
"""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict, deque
from typing import Callable

import torch

from ..errors import CommAborted, CommError, CommTimeout
from .base import Communicator, reduce_tensors

__all__ = ["ThreadWorld", "ThreadCommunicator", "default_timeout"]

_POLL = 0.05


def default_timeout() -> float:
    """Seconds a collective may wait: ``SBPFLOW_TIMEOUT`` (default 300)."""
    return float(os.environ.get("SBPFLOW_TIMEOUT", "300"))


class _Slot:
    __slots__ = ("kind", "data", "done")

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.data: dict[int, object] = {}
        self.done = 0


class ThreadWorld:
    """Shared state of the ranks of one in-process run."""

    def __init__(self, world_size: int, timeout: float | None = None) -> None:
        self.world_size = world_size
        self.timeout = default_timeout() if timeout is None else timeout
        self.cond = threading.Condition()
        self.slots: dict[tuple, _Slot] = {}
        self.mailboxes: dict[tuple[int, int], deque] = defaultdict(deque)
        self.failure: tuple[int, BaseException] | None = None
        self.finished: set[int] = set()

    def abort(self, rank: int, exc: BaseException) -> None:
        with self.cond:
            if self.failure is None:
                self.failure = (rank, exc)
            self.cond.notify_all()

    def finish(self, rank: int) -> None:
        with self.cond:
            self.finished.add(rank)
            self.cond.notify_all()

    def wait(self, ready: Callable[[], bool], what: str, missing: Callable[[], list[int]],
             rank: int) -> None:
        """Wait on ``self.cond`` (held by the caller) until ``ready()``; never forever."""
        deadline = time.monotonic() + self.timeout
        while not ready():
            if self.failure is not None and self.failure[0] != rank:
                r, exc = self.failure
                raise CommAborted(f"{what} on rank {rank} abandoned: rank {r} failed with "
                                  f"{type(exc).__name__}: {exc}")
            gone = [m for m in missing() if m in self.finished]
            if gone:
                raise CommError(f"{what} on rank {rank} waits for rank(s) {gone}, which already "
                                f"returned from the launched function without joining it")
            left = deadline - time.monotonic()
            if left <= 0:
                raise CommTimeout(f"{what} on rank {rank} timed out after {self.timeout:g} s "
                                  f"waiting for rank(s) {missing()} (SBPFLOW_TIMEOUT)")
            self.cond.wait(min(left, _POLL))


class ThreadCommunicator(Communicator):
    """One rank of a `ThreadWorld`."""

    backend = "threads"

    def __init__(self, world: ThreadWorld, rank: int) -> None:
        super().__init__(rank, world.world_size)
        self.world = world
        self._seq: dict[tuple, int] = defaultdict(int)

    # -- the rendezvous ------------------------------------------------------------------------
    def _collective(self, kind: str, group: tuple, payload, compute: Callable[[dict], object]):
        w = self.world
        seq = self._seq[group]
        self._seq[group] = seq + 1
        key = (group, seq)
        what = f"{kind} over ranks {list(group)}"
        with w.cond:
            slot = w.slots.get(key)
            if slot is None:
                slot = w.slots[key] = _Slot(kind)
            if slot.kind != kind:
                raise CommError(f"rank {self.rank} called {kind} over ranks {list(group)} while "
                                f"another member called {slot.kind} (call #{seq} on this group); "
                                f"every rank must issue the same collectives in the same order")
            slot.data[self.rank] = payload
            w.cond.notify_all()
            w.wait(lambda: len(slot.data) == len(group), what,
                   lambda: [r for r in group if r not in slot.data], self.rank)
        try:
            result = compute(slot.data)
        finally:
            with w.cond:
                slot.done += 1
                if slot.done == len(group):
                    w.slots.pop(key, None)
                    w.cond.notify_all()
                else:
                    # Others may still be reading our input: stay until they are done.
                    w.wait(lambda: slot.done == len(group), what + " (finishing)",
                           lambda: [], self.rank)
        return result

    def _all_gather(self, tensor, group, shapes, assemble):
        return self._collective("all_gather", group, tensor,
                                lambda d: assemble([d[r] for r in group]))

    def _all_to_all(self, pieces, group, shapes, assemble):
        i = group.index(self.rank)
        return self._collective("all_to_all", group, pieces,
                                lambda d: assemble([d[r][i] for r in group]))

    def _reduce_scatter(self, pieces, group, op):
        i = group.index(self.rank)
        return self._collective("reduce_scatter", group, pieces,
                                lambda d: reduce_tensors([d[r][i] for r in group], op))

    def _all_reduce(self, tensor, group, op):
        return self._collective("all_reduce", group, tensor,
                                lambda d: reduce_tensors([d[r] for r in group], op))

    def _broadcast(self, tensor, src, group):
        payload = tensor if self.rank == src else None
        return self._collective("broadcast", group, payload, lambda d: d[src].clone())

    def _barrier(self, group):
        self._collective("barrier", group, None, lambda d: None)

    def _exchange(self, sends, recvs):
        w = self.world
        with w.cond:
            for dst, t in sends:
                # Copy on send: the sender may change its tensor as soon as we return.
                w.mailboxes[(self.rank, dst)].append(t.detach().clone())
            if sends:
                w.cond.notify_all()
        out = []
        for src, shape, dtype, device in recvs:
            box = w.mailboxes[(src, self.rank)]
            with w.cond:
                w.wait(lambda: len(box) > 0, f"recv from rank {src}", lambda: [src], self.rank)
                t = box.popleft()
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise CommError(f"rank {self.rank} expected a {dtype} tensor of shape {shape} "
                                f"from rank {src}, got {t.dtype} {tuple(t.shape)}")
            out.append(t.to(device))
        return out

    def device(self, device_type: str) -> torch.device:
        if device_type == "cpu":
            return torch.device("cpu")
        n = torch.cuda.device_count()
        if self.world_size > n:
            raise CommError(
                f"the threads backend needs one GPU per rank: world size {self.world_size} but "
                f"{n} cuda device(s); several ranks on one GPU would deadlock autograd. Use fewer "
                f"ranks, cpu placements, or backend='torch'")
        return torch.device("cuda", self.rank)
