"""Message channels over direct TCP sockets between the processes of a torch-backend world.

Each process listens on one socket (on the interface that reaches the world's store host, port
0: loopback in a one-host world) and publishes ``host:port`` in the store once; a post opens one
persistent connection per destination on first use (``TCP_NODELAY``), proves to the listener
that it holds the world's secret and checks the listener's proof (`auth`), then writes typed
frames (`wire`: no pickle of arbitrary objects, tensors as raw bytes; to a listener of this
host, a message's large tensors go through a shared-memory ring, `shm_ring`, the frame naming
where). One receiver thread a process (``selectors``) reads every connection, puts the frames in
per-channel deques for `SocketChannels.take`, or hands them to a listener (`listen`); a
connection that does not authenticate within `_HANDSHAKE_S` or sends a frame that does not
parse is dropped with a warning naming its address, and the channels go on. A process whose
socket cannot be set up publishes ``store`` and falls back, with a warning, to the c10d store's
queues (`StoreChannels`: frames with an HMAC tag of the secret). See docs/runtime.md.
"""

from __future__ import annotations

import datetime
import logging
import os
import selectors
import socket
import threading
import time
from collections import deque
from typing import Any, Callable

import torch.distributed as dist

from ..errors import CommError, WireError
from .auth import ServerHandshake, client_handshake, world_secret
from .channels import StoreChannels
from .progress import own_connection
from .shm_ring import RING_MIN, Ring, ring_bytes
from .wire import FrameReader, copied, encode, encode_body, ring_frame

__all__ = ["SocketChannels", "address_key", "local_address"]

_LOG = logging.getLogger("sbpflow.comm")
_STORE = b"store"  # the published address of a process that reads the store's queues
_CHUNK = 1 << 18  # bytes a recv asks for
_HANDSHAKE_S = 10.0  # s a new connection has to prove it belongs to the world
_RING_OFFER = "\x00sbpflow/ring"  # the channel of a sender's ring offer (`shm_ring`)


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
                 force_store: bool = False, secret: bytes | None = None) -> None:
        self.rank = rank
        self.timeout = timeout  # s a post waits for a peer's address
        self._store = own_connection(store, datetime.timedelta(seconds=timeout))
        self._raw_store = store
        self.secret = secret if secret is not None else world_secret(self._store, rank, timeout)
        self._lock = threading.Lock()  # the peers table and the fallback StoreChannels
        self._peers: dict[int, _Peer | None] = {}  # None: the peer reads the store's queues
        self._via_store: StoreChannels | None = None
        self._receiver: _Receiver | None = None
        try:
            if force_store:
                raise OSError("SBPFLOW_CHANNELS=store")
            self._receiver = _Receiver(rank, local_address(store), self.secret)
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
                self._via_store = StoreChannels(self.rank, self._raw_store, self.secret)
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
            try:
                client_handshake(sock, self.secret)
            except (OSError, WireError) as exc:
                sock.close()
                raise _error(src, dst, channel, f"authenticating with {host}:{port} (is "
                             f"SBPFLOW_SECRET the same on every rank?)", exc) from exc
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            ring = self._offer_ring(sock, host)
            sock.settimeout(None)
            peer = self._peers[dst] = _Peer(sock, f"{host}:{port}", ring)
            return peer

    def _offer_ring(self, sock: socket.socket, host: str) -> Ring | None:
        """A shared-memory ring for the large messages to a listener of this host (the
        interface this process listens on), if it maps it (`shm_ring`); else None."""
        capacity = ring_bytes()
        if (capacity <= 0 or self._receiver is None or host != self._receiver.host
                or not hasattr(os, "memfd_create")):
            return None
        try:
            ring = Ring.create(capacity)
        except OSError:
            return None
        try:
            sock.sendall(b"".join(encode(self.rank, _RING_OFFER, (ring.pid, ring.fd, capacity))))
            sock.settimeout(_HANDSHAKE_S)
            taken = sock.recv(1) == b"\x01"
        except OSError:
            taken = False
        if not taken:
            ring.close()
            return None
        return ring

    def post(self, src: int, dst: int, channel: str, message: Any) -> None:
        """Send ``message`` to ``dst``'s ``channel``; a peer gone (connection refused, reset
        or closed) raises `CommError` naming ``src``, ``dst`` and ``channel``; a message that is
        not plain data and tensors, `WireError`. To itself: a decoded copy of its frame straight
        into its own deque."""
        if dst == self.rank and self._receiver is not None:
            self._receiver.put(channel, (src, copied(src, channel, message)))
            return
        peer = None if dst == self.rank else self._peer(src, dst, channel)
        if peer is None:
            self._store_channels().post(src, dst, channel, message)
            return
        try:
            peer.post(src, channel, message)
        except OSError as exc:
            raise _error(src, dst, channel, f"sending to {peer.address}", exc) from exc

    def take(self, rank: int, channel: str, timeout: float,
             alive: Callable[[], None]) -> list[tuple[int, Any]]:
        """Everything that arrived for ``channel``, waiting up to ``timeout`` s for the first;
        the receiver thread's failure raises `CommError`."""
        if self._receiver is None:
            return self._store_channels().take(rank, channel, timeout, alive)
        return self._receiver.take(channel, timeout)

    def listen(self, channel: str, deliver: Callable[[list], None],
               failed: Callable[[BaseException], None]) -> bool:
        """Hand what arrives for ``channel`` to ``deliver(items)`` on the receiver thread, in
        order, those already queued first (no `take` wake-up in between); ``failed(exc)``
        once if the receiver thread fails. False (nothing done) on the store fallback or a
        failed receiver."""
        if self._receiver is None:
            return False
        return self._receiver.listen(channel, deliver, failed)

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


def _error(src: int, dst: int, channel: str, what: str, exc: BaseException) -> CommError:
    return CommError(f"post from rank {src} to rank {dst} on message channel {channel!r}: "
                     f"{what} failed: {type(exc).__name__}: {exc} (rank {dst} has ended or "
                     f"failed?)")


class _Peer:
    """One outgoing connection, and its shared-memory ring when the peer is on this host; a
    lock keeps concurrent posts' frames whole and in order (and their ring records)."""

    def __init__(self, sock: socket.socket, address: str, ring: Ring | None = None) -> None:
        self.sock, self.address, self.ring = sock, address, ring
        self.lock = threading.Lock()

    def post(self, src: int, channel: str, message: Any) -> None:
        """Send ``message``: its tensors' bytes through the ring when they are `RING_MIN` or
        more and fit its free space (the frame then names where), else inline."""
        body = encode_body(message)
        views = body[1]
        if self.ring is not None and views and sum(v.nbytes for v in views) >= RING_MIN:
            with self.lock:
                pos = self.ring.place(views)
                if pos is not None:
                    self.sock.sendall(ring_frame(src, channel, body[0], views, pos))
                else:
                    self._write(encode(src, channel, message, body))
            return
        self.send(encode(src, channel, message, body))

    def send(self, parts: list) -> None:
        """Write a frame's parts (`wire.encode`) whole, after any frame already being sent."""
        with self.lock:
            self._write(parts)

    def _write(self, parts: list) -> None:
        if sum(memoryview(p).nbytes for p in parts) < _CHUNK:  # one segment (TCP_NODELAY)
            self.sock.sendall(b"".join(parts))
        else:  # no copy of a large tensor's bytes
            for part in parts:
                self.sock.sendall(part)

    def close(self) -> None:
        with self.lock:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.sock.close()
            if self.ring is not None:
                self.ring.close()
                self.ring = None


class _Conn:
    """An accepted connection: its address, its handshake until the peer proved it holds the
    secret (then None), and the frames it sends."""

    def __init__(self, sock: socket.socket, address: str, secret: bytes) -> None:
        self.sock, self.address = sock, address
        self.handshake: ServerHandshake | None = ServerHandshake(secret)
        self.since = time.monotonic()
        self.frames = FrameReader()


class _Listener:
    """Where a listened channel's items go (`_Receiver.listen`); ``order`` keeps them in
    arrival order."""

    def __init__(self, deliver: Callable[[list], None],
                 failed: Callable[[BaseException], None]) -> None:
        self.deliver, self.failed = deliver, failed
        self.order = threading.Lock()


class _Receiver:
    """The listening socket and the thread that reads every incoming connection into
    per-channel deques (one lock; a condition a channel, so a frame wakes only its taker).
    Only connections that proved they hold ``secret`` are read for frames."""

    def __init__(self, rank: int, host: str, secret: bytes) -> None:
        self.rank, self.secret = rank, secret
        self.listener = socket.create_server((host, 0), backlog=128)
        self.host, self.port = host, self.listener.getsockname()[1]
        self.listener.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()  # close() wakes the select
        self._lock = threading.Lock()
        self._boxes: dict[str, tuple[deque, threading.Condition]] = {}
        self._listeners: dict[str, _Listener] = {}  # channels handed over as they arrive
        self.error: BaseException | None = None
        self.dropped = 0  # connections dropped: unauthenticated, or a frame that did not parse
        self._pending: set[_Conn] = set()  # accepted, not yet authenticated
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
            listener = self._listeners.get(channel)
            if listener is None:
                queue, cond = self._box(channel)
                queue.append(item)
                cond.notify()
                return
        with listener.order:
            listener.deliver([item])

    def listen(self, channel: str, deliver: Callable[[list], None],
               failed: Callable[[BaseException], None]) -> bool:
        """`SocketChannels.listen`: the queued items go first, under the listener's order
        lock, which a `put` after the registration waits for."""
        listener = _Listener(deliver, failed)
        with listener.order:
            with self._lock:
                if self.error is not None or not self.thread.is_alive():
                    return False
                queue, _ = self._box(channel)
                pending = list(queue)
                queue.clear()
                self._listeners[channel] = listener
            if pending:
                deliver(pending)
        return True

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
                # a connection still proving itself has _HANDSHAKE_S; look again within 1 s
                for key, _ in self._sel.select(1.0 if self._pending else None):
                    if key.fileobj is self._wake_r:
                        return
                    if key.fileobj is self.listener:
                        self._accept()
                    else:
                        self._read(key.data)
                self._expire()
        except BaseException as exc:  # noqa: BLE001 - reported to every take and listener
            with self._lock:
                self.error = exc
                for _, cond in self._boxes.values():
                    cond.notify_all()
                listeners, self._listeners = list(self._listeners.values()), {}
            for listener in listeners:
                listener.failed(exc)
        finally:
            self._shut()

    def _accept(self) -> None:
        """Take a new connection and send it the challenge; nothing it sends is read as a
        frame before it answers."""
        try:
            sock, addr = self.listener.accept()
        except BlockingIOError:
            return
        sock.setblocking(False)
        conn = _Conn(sock, ":".join(map(str, addr[:2])), self.secret)
        try:  # a fresh socket's send buffer is empty: the few bytes go at once
            if sock.send(conn.handshake.hello) != len(conn.handshake.hello):
                raise OSError("the challenge did not fit the send buffer")
        except OSError:
            sock.close()
            return
        self._pending.add(conn)
        self._sel.register(sock, selectors.EVENT_READ, conn)

    def _read(self, conn: _Conn) -> None:
        """Read what ``conn`` has: handshake bytes, then frames, delivered whole. A closed
        connection (its sender closed, or ended) is dropped quietly; one that fails the
        handshake or sends a frame that does not parse, with a warning."""
        try:
            data = conn.sock.recv(_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # reset by a peer that ended
            data = b""
        if not data:
            self._close(conn)
            return
        try:
            if conn.handshake is not None:
                done = conn.handshake.feed(data)
                if done is None:
                    return
                reply, data = done
                conn.sock.setblocking(True)  # 32 bytes to a peer waiting for them
                conn.sock.sendall(reply)
                conn.sock.setblocking(False)
                conn.handshake = None
                self._pending.discard(conn)
            for src, channel, message in conn.frames.feed(data):
                if channel == _RING_OFFER:
                    self._take_ring(conn, message)
                else:
                    self.put(channel, (src, message))
            if conn.frames.error is not None:
                self._drop(conn, str(conn.frames.error))
        except (WireError, OSError) as exc:
            self._drop(conn, str(exc))

    def _take_ring(self, conn: _Conn, offer: Any) -> None:
        """Map the ring a sender of this host offers (`shm_ring.Ring.open`) and say whether
        (one byte: it waits for it); one that cannot be mapped is declined."""
        if conn.frames.ring is not None or not isinstance(offer, tuple) or len(offer) != 3:
            raise WireError("a second ring offer, or one of the wrong form")
        try:
            conn.frames.ring = Ring.open(*offer)
        except WireError as exc:
            _LOG.info("sbpflow rank %d: declined the ring of %s: %s", self.rank, conn.address,
                      exc)
        conn.sock.send(b"\x01" if conn.frames.ring is not None else b"\x00")

    def _drop(self, conn: _Conn, why: str) -> None:
        self.dropped += 1
        _LOG.warning("sbpflow rank %d: dropped the message connection from %s: %s", self.rank,
                     conn.address, why)
        self._close(conn)

    def _close(self, conn: _Conn) -> None:
        self._pending.discard(conn)
        self._sel.unregister(conn.sock)
        conn.sock.close()
        if conn.frames.ring is not None:
            conn.frames.ring.close()

    def _expire(self) -> None:
        """Drop the connections that have not proved themselves within `_HANDSHAKE_S`."""
        now = time.monotonic()
        for conn in [c for c in self._pending if now - c.since > _HANDSHAKE_S]:
            self._drop(conn, f"no proof of the world's secret within {_HANDSHAKE_S:g} s")

    def _shut(self) -> None:
        for key in list(self._sel.get_map().values()):
            key.fileobj.close()
            if isinstance(key.data, _Conn) and key.data.frames.ring is not None:
                key.data.frames.ring.close()
        self._sel.close()

    def stop(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self.thread.join(5.0)
        self._wake_w.close()
