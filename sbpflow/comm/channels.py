"""Message channels: asynchronous point-to-point queues of Python objects between ranks.

`Communicator.post(dst, channel, message)` queues a message for rank ``dst`` and returns at
once; `Communicator.inbox(channel, timeout)` returns what arrived for this rank as ``(src,
message)`` pairs, in the order each sender posted. Unlike ``send`` / ``recv``, the receiver
needs to know neither the sender nor the shapes, and an idle channel is not a hang: the actor
runtime's req / ack messages travel here. `ThreadChannels` keeps one deque a (rank, channel)
in the world (tensors copied on post); `StoreChannels` uses the c10d store's queues
(``queue_push`` / ``queue_pop``), typed frames (`wire`) with an HMAC tag of the world's secret
(`auth.seal`), a reader thread a channel: the torch backend's fallback, whose channels are
direct sockets (`socket_channels.SocketChannels`). Nothing read from the store is unpickled. See
docs/runtime.md, 'Message channels'.
"""

from __future__ import annotations

import datetime
import logging
import threading
from collections import deque
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..errors import CommError, WireError
from ..utils import rebuild_sequence
from .auth import seal, unseal
from .progress import own_connection
from .wire import copied, encode, parse_frame

__all__ = ["ThreadChannels", "StoreChannels", "copy_tensors", "tensor_bytes"]

_LOG = logging.getLogger("sbpflow.comm")
_CLOSE = b""  # a reader's own wake-up: sealed messages are never empty
_READ_TIMEOUT = datetime.timedelta(hours=1)  # a blocked pop; re-entered on expiry


def copy_tensors(obj: Any) -> Any:
    """``obj`` with every tensor inside (tuples, lists, dicts) replaced by a detached copy, so
    the receiver never sees the sender change it."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, (tuple, list)):
        return rebuild_sequence(obj, [copy_tensors(o) for o in obj]) if obj else obj
    if isinstance(obj, dict):
        return {k: copy_tensors(v) for k, v in obj.items()}
    return obj


_NO_TENSORS = frozenset({int, float, str, bool, bytes, type(None)})


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors inside ``obj`` (tuples, lists, dicts): what a message moves."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):  # (a req / ack's ints: no call a field)
        return sum(tensor_bytes(o) for o in obj if type(o) not in _NO_TENSORS)
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    return 0


class ThreadChannels:
    """The channels of one in-process world: a deque and a condition per (rank, channel), all
    sharing one lock (a post wakes only the receiver it is for)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._boxes: dict[tuple[int, str], tuple[deque, threading.Condition]] = {}

    def _box(self, rank: int, channel: str) -> tuple[deque, threading.Condition]:
        box = self._boxes.get((rank, channel))
        if box is None:
            box = self._boxes[(rank, channel)] = (deque(), threading.Condition(self._lock))
        return box

    def post(self, src: int, dst: int, channel: str, message: Any) -> None:
        with self._lock:
            queue, cond = self._box(dst, channel)
            queue.append((src, message))
            cond.notify()

    def take(self, rank: int, channel: str, timeout: float,
             alive: Callable[[], None]) -> list[tuple[int, Any]]:
        """Everything queued for ``rank`` on ``channel``, waiting up to ``timeout`` s for the
        first message; when none came, ``alive()`` may raise (the world was aborted)."""
        with self._lock:
            queue, cond = self._box(rank, channel)
            if not queue and timeout > 0:
                cond.wait(timeout)
            out = list(queue)
            queue.clear()
        if not out:
            alive()
        return out


class StoreChannels:
    """One process's channels over the c10d store: rank r's channel c is the store queue
    ``sbpflow/channel/c/r``. Posts go through one connection of their own; each channel read
    gets a daemon thread blocked in ``queue_pop`` on another, which feeds a local deque. A
    message is a `wire` frame sealed with ``secret``; one whose tag or frame is wrong is dropped
    with a warning."""

    def __init__(self, rank: int, store: dist.Store, secret: bytes) -> None:
        self.rank, self.secret = rank, secret
        self._store = store
        self._post_conn = self._connection()
        self._post_lock = threading.Lock()
        self._readers: dict[str, _QueueReader] = {}
        self._lock = threading.Lock()

    def _connection(self) -> dist.Store:
        return own_connection(self._store, _READ_TIMEOUT)

    @staticmethod
    def key(rank: int, channel: str) -> str:
        return f"sbpflow/channel/{channel}/{rank}"

    def post(self, src: int, dst: int, channel: str, message: Any) -> None:
        """Push ``message`` onto ``dst``'s store queue; a store failure (connection lost,
        store host gone: ``DistNetworkError``, ``DistStoreError``, ``RuntimeError``) raises
        `CommError`, as every communication failure does."""
        if dst == self.rank:  # to itself: straight into its reader's deque, no store round trip
            with self._lock:
                reader = self._readers.get(channel)
            if reader is not None:
                reader.put((src, copied(src, channel, message)))
                return
        data = seal(self.secret, b"".join(encode(src, channel, message)))
        try:
            with self._post_lock:
                self._post_conn.queue_push(self.key(dst, channel), data)
        except (RuntimeError, OSError) as exc:  # DistError subclasses RuntimeError
            raise CommError(f"post from rank {src} to rank {dst} on message channel "
                            f"{channel!r}: the c10d store failed: {type(exc).__name__}: "
                            f"{exc}") from exc

    def take(self, rank: int, channel: str, timeout: float,
             alive: Callable[[], None]) -> list[tuple[int, Any]]:
        with self._lock:
            reader = self._readers.get(channel)
            if reader is None:
                reader = self._readers[channel] = _QueueReader(self._connection(),
                                                          self.key(rank, channel), self.secret)
        return reader.take(timeout)

    def close(self) -> None:
        """Wake and stop the reader threads (a close message on each one's own queue)."""
        with self._lock:
            readers, self._readers = list(self._readers.values()), {}
        for reader in readers:
            reader.stop(self._post_conn, self._post_lock)


class _QueueReader:
    """A daemon thread that pops one store queue into a local deque: ``(src, message)`` of
    each frame sealed with ``secret``."""

    def __init__(self, conn: dist.Store, key: str, secret: bytes) -> None:
        self.conn, self.key, self.secret = conn, key, secret
        self.cond = threading.Condition()
        self.queue: deque = deque()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, name=f"sbpflow-channel-{key}",
                                       daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            try:
                data = self.conn.queue_pop(self.key)
            except dist.DistStoreError as exc:
                if "timeout" in str(exc).lower():
                    continue  # an idle hour: wait again
                self._fail(exc)
                return
            except RuntimeError as exc:  # the store is gone (its host process ended)
                self._fail(exc)
                return
            if data == _CLOSE:
                return
            try:
                src, _, message = parse_frame(unseal(self.secret, data))
            except WireError as exc:
                _LOG.warning("sbpflow: dropped a message of store queue %r: %s", self.key, exc)
                continue
            self.put((src, message))

    def put(self, item: tuple) -> None:
        with self.cond:
            self.queue.append(item)
            self.cond.notify()

    def _fail(self, exc: BaseException) -> None:
        with self.cond:
            self.error = exc
            self.cond.notify()

    def take(self, timeout: float) -> list[tuple[int, Any]]:
        with self.cond:
            if not self.queue and self.error is None and timeout > 0:
                self.cond.wait(timeout)
            out = list(self.queue)
            self.queue.clear()
            if not out and self.error is not None:
                raise CommError(f"message channel {self.key!r}: the c10d store failed: "
                                f"{self.error}")
        return out

    def stop(self, conn: dist.Store, lock: threading.Lock) -> None:
        try:
            with lock:
                conn.queue_push(self.key, _CLOSE)
        except RuntimeError:  # the store is gone: so is the reader's blocked pop
            return
        self.thread.join(5.0)
