"""Message channels over direct TCP sockets between the processes of a torch-backend world.

Each process listens on one socket (on the interface that reaches the world's store host, port
0) and publishes ``host:port`` in the store once; a post opens one persistent connection per
destination on first use (``TCP_NODELAY``) and writes a length-prefixed pickled frame ``(src,
channel, message)``. One receiver thread a process (``selectors``) reads every connection and
puts the frames in per-channel deques, waking the waiting `SocketChannels.take`. A process
whose socket cannot be set up publishes ``store`` and falls back, saying so in a warning, to
the c10d store's queues (`StoreChannels`), which its peers then post to. See docs/runtime.md,
'Message channels'.
"""

from __future__ import annotations

import datetime
import io
import logging
import os
import pickle
import selectors
import socket
import struct
import threading
from collections import deque
from typing import Any, Callable

import numpy
import torch
import torch.distributed as dist

from ..errors import CommError
from .channels import StoreChannels
from .progress import own_connection

__all__ = ["SocketChannels", "address_key", "local_address"]

_LOG = logging.getLogger("sbpflow.comm")
_HEADER = struct.Struct("!Q")  # a frame's payload length
_STORE = b"store"  # the published address of a process that reads the store's queues
_CHUNK = 1 << 18  # bytes a recv asks for


def address_key(rank: int) -> str:
    """The store key where rank ``rank`` publishes its channel address."""
    return f"sbpflow/channel-address/{rank}"


def local_address(store: dist.Store) -> str:
    """The IP address of this host's interface that reaches the store's host (the store's
    ``host``, else ``MASTER_ADDR``, else loopback): what peers of other hosts can connect to."""
    root = store
    while isinstance(root, dist.PrefixStore):
        root = root.underlying_store
    host = getattr(root, "host", None) or os.environ.get("MASTER_ADDR") or "127.0.0.1"
    try:
        info = socket.getaddrinfo(host, 1, socket.AF_INET, socket.SOCK_DGRAM)[0][4]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(info)  # a UDP connect sends nothing: it only picks the route
            return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"


class SocketChannels:
    """One process's channels: a listening socket, one outgoing connection a destination, one
    receiver thread. ``post`` / ``take`` / ``close`` as `StoreChannels`; ``transport`` says which
    path this process receives on (``"socket"``, or ``"store"`` after a fallback)."""

    def __init__(self, rank: int, store: dist.Store, timeout: float = 300.0,
                 force_store: bool = False) -> None:
        self.rank = rank
        self.timeout = timeout  # s a post waits for a peer's address
        self._store = own_connection(store, datetime.timedelta(seconds=timeout))
        self._raw_store = store
        self._lock = threading.Lock()  # the peers table and the fallback StoreChannels
        self._peers: dict[int, _Peer | None] = {}  # None: the peer reads the store's queues
        self._via_store: StoreChannels | None = None
        self._receiver: _Receiver | None = None
        try:
            if force_store:
                raise OSError("SBPFLOW_CHANNELS=store")
            self._receiver = _Receiver(rank, local_address(store))
            address = f"{self._receiver.host}:{self._receiver.port}".encode()
        except OSError as exc:
            _LOG.warning("sbpflow rank %d: message channels fall back to the c10d store's "
                         "queues (no listening socket: %s)", rank, exc)
            address = _STORE
        self.transport = "socket" if self._receiver is not None else "store"
        self._store.set(address_key(rank), address)

    def _store_channels(self) -> StoreChannels:
        with self._lock:
            if self._via_store is None:
                self._via_store = StoreChannels(self.rank, self._raw_store)
            return self._via_store

    def _peer(self, src: int, dst: int, channel: str) -> "_Peer | None":
        """The connection to ``dst`` (None: post through the store), opened on first use."""
        peer = self._peers.get(dst, False)
        if peer is not False:
            return peer
        with self._lock:
            if dst in self._peers:
                return self._peers[dst]
            try:
                address = self._store.get(address_key(dst))
            except (RuntimeError, OSError) as exc:
                raise _error(src, dst, channel, f"its address was not published in the "
                             f"store within {self.timeout:g} s", exc) from exc
            if address == _STORE:
                self._peers[dst] = None
                return None
            host, port = address.decode().rsplit(":", 1)
            try:
                sock = socket.create_connection((host, int(port)), timeout=self.timeout)
            except OSError as exc:
                raise _error(src, dst, channel, f"connecting to {host}:{port}", exc) from exc
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            peer = self._peers[dst] = _Peer(sock, f"{host}:{port}")
            return peer

    def post(self, src: int, dst: int, channel: str, message: Any) -> None:
        """Send ``message`` to ``dst``'s ``channel``; a peer gone (connection refused, reset
        or closed) raises `CommError` naming ``src``, ``dst`` and ``channel``. To itself: a
        pickled copy straight into its own deque."""
        if dst == self.rank and self._receiver is not None:
            self._receiver.put(channel, (src, pickle.loads(_dumps(message))))
            return
        peer = None if dst == self.rank else self._peer(src, dst, channel)
        if peer is None:
            self._store_channels().post(src, dst, channel, message)
            return
        data = _dumps((src, channel, message))
        try:
            peer.send(data)
        except OSError as exc:
            raise _error(src, dst, channel, f"sending to {peer.address}", exc) from exc

    def take(self, rank: int, channel: str, timeout: float,
             alive: Callable[[], None]) -> list[tuple[int, Any]]:
        """Everything that arrived for ``channel``, waiting up to ``timeout`` s for the first;
        the receiver thread's failure raises `CommError`."""
        if self._receiver is None:
            return self._store_channels().take(rank, channel, timeout, alive)
        return self._receiver.take(channel, timeout)

    def close(self) -> None:
        """Stop the receiver thread, close the listening socket and every connection."""
        with self._lock:
            peers, self._peers = [p for p in self._peers.values() if p is not None], {}
            via_store, self._via_store = self._via_store, None
        for peer in peers:
            peer.close()
        if self._receiver is not None:
            self._receiver.stop()
        if via_store is not None:
            via_store.close()


def _tensor(data: bytes, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    """A tensor of ``shape`` / ``dtype`` from its raw bytes (a storage of its own)."""
    out = torch.empty(shape, dtype=dtype)
    if data:  # (numpy copies from a read-only buffer; torch.frombuffer would warn)
        out.reshape(-1).view(torch.uint8).numpy()[:] = numpy.frombuffer(data, numpy.uint8)
    return out


class _Pickler(pickle.Pickler):
    """Pickles a plain CPU tensor as its raw bytes, dtype and shape: torch's own pickling
    goes through ``torch.save`` / ``torch.load`` of its storage, some 100 us a message each
    way where this takes about 20 (messages carry activations between pipeline stages).
    Other tensors (autograd, views with conjugate bits, subclasses, other devices) as torch
    pickles them."""

    def reducer_override(self, obj: Any) -> Any:
        if (type(obj) is not torch.Tensor or obj.device.type != "cpu" or obj.requires_grad
                or obj.layout != torch.strided or obj.is_conj() or obj.is_neg()
                or obj.is_quantized):
            return NotImplemented
        flat = obj.detach().contiguous().reshape(-1)
        return _tensor, (flat.view(torch.uint8).numpy().tobytes(), obj.dtype,
                         tuple(obj.shape))


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def _error(src: int, dst: int, channel: str, what: str, exc: BaseException) -> CommError:
    return CommError(f"post from rank {src} to rank {dst} on message channel {channel!r}: "
                     f"{what} failed: {type(exc).__name__}: {exc} (rank {dst} has ended or "
                     f"failed?)")


class _Peer:
    """One outgoing connection; a lock keeps concurrent posts' frames whole and in order."""

    def __init__(self, sock: socket.socket, address: str) -> None:
        self.sock, self.address = sock, address
        self.lock = threading.Lock()

    def send(self, data: bytes) -> None:
        header = _HEADER.pack(len(data))
        with self.lock:
            if len(data) < _CHUNK:  # one segment for a small frame (TCP_NODELAY sends each)
                self.sock.sendall(header + data)
            else:  # no copy of a large payload
                self.sock.sendall(header)
                self.sock.sendall(data)

    def close(self) -> None:
        with self.lock:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.sock.close()


class _Receiver:
    """The listening socket and the thread that reads every incoming connection into
    per-channel deques (one lock; a condition a channel, so a frame wakes only its taker)."""

    def __init__(self, rank: int, host: str) -> None:
        self.listener = socket.create_server((host, 0), backlog=128)
        self.host, self.port = host, self.listener.getsockname()[1]
        self.listener.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()  # close() wakes the select
        self._lock = threading.Lock()
        self._boxes: dict[str, tuple[deque, threading.Condition]] = {}
        self.error: BaseException | None = None
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.listener, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self.thread = threading.Thread(target=self._loop, name=f"sbpflow-rank{rank}-channels",
                                       daemon=True)
        self.thread.start()

    def _box(self, channel: str) -> tuple[deque, threading.Condition]:
        box = self._boxes.get(channel)
        if box is None:
            box = self._boxes[channel] = (deque(), threading.Condition(self._lock))
        return box

    def put(self, channel: str, item: tuple) -> None:
        with self._lock:
            queue, cond = self._box(channel)
            queue.append(item)
            cond.notify()

    def take(self, channel: str, timeout: float) -> list[tuple[int, Any]]:
        with self._lock:
            queue, cond = self._box(channel)
            if not queue and self.error is None and timeout > 0:
                cond.wait(timeout)
            out = list(queue)
            queue.clear()
            if not out and self.error is not None:
                raise CommError(f"message channel {channel!r} of this rank: the receiver "
                                f"thread failed: {type(self.error).__name__}: {self.error}")
        return out

    def _loop(self) -> None:
        try:
            while True:
                for key, _ in self._sel.select():
                    if key.fileobj is self._wake_r:
                        return
                    if key.fileobj is self.listener:
                        self._accept()
                    else:
                        self._read(key.fileobj, key.data)
        except BaseException as exc:  # noqa: BLE001 - reported to every take
            with self._lock:
                self.error = exc
                for _, cond in self._boxes.values():
                    cond.notify_all()
        finally:
            self._shut()

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except BlockingIOError:
            return
        conn.setblocking(False)
        self._sel.register(conn, selectors.EVENT_READ, bytearray())

    def _read(self, conn: socket.socket, buf: bytearray) -> None:
        """Append what ``conn`` has to ``buf`` and deliver its whole frames; a closed
        connection (its sender closed, or ended) is dropped."""
        try:
            data = conn.recv(_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # reset by a peer that ended
            data = b""
        if not data:
            self._sel.unregister(conn)
            conn.close()
            return
        buf += data
        start, end = 0, len(buf)
        while end - start >= _HEADER.size:
            (n,) = _HEADER.unpack_from(buf, start)
            if end - start - _HEADER.size < n:
                break
            lo = start + _HEADER.size
            with memoryview(buf) as whole, whole[lo:lo + n] as frame:  # released: buf resizes
                src, channel, message = pickle.loads(frame)
            self.put(channel, (src, message))
            start += _HEADER.size + n
        if start:
            del buf[:start]

    def _shut(self) -> None:
        for key in list(self._sel.get_map().values()):
            key.fileobj.close()
        self._sel.close()

    def stop(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self.thread.join(5.0)
        self._wake_w.close()
