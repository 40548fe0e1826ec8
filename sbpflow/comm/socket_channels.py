"""Message channels over direct TCP sockets between the processes of a torch-backend world.

Each process listens on one socket (on the interface that reaches the world's store host, port
0: loopback in a one-host world) and publishes ``host:port`` in the store once; a post opens one
persistent connection per destination on first use (``TCP_NODELAY``), proves to the listener
that it holds the world's secret and checks the listener's proof (`auth`), then writes typed
frames (`wire`: no pickle of arbitrary objects, tensors as raw bytes; to a listener of this
host, a message's large tensors go through a shared-memory ring, `shm_ring`, the frame naming
where). The receiving side is `receiver.Receiver`: a thread that reads every connection (or
the waiting consumer thread itself, `lead`) into per-channel deques for `take`, or to a
listener (`listen`); a connection that does not authenticate within `HANDSHAKE_S` or sends a
frame that does not parse is dropped with a warning naming its address. A process whose
socket cannot be set up publishes ``store`` and falls back, with a warning, to the c10d store's
queues (`StoreChannels`: frames with an HMAC tag of the secret). See docs/runtime.md.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
from typing import Any, Callable

import torch.distributed as dist

from ..errors import CommError, WireError
from .auth import client_handshake, world_secret
from .channels import StoreChannels
from .progress import own_connection
from .receiver import HANDSHAKE_S, LEADS, RING_OFFER, Receiver
from .shm_ring import RING_MIN, Ring, ring_bytes
from .wire import copied, encode, encode_any, ring_frame

__all__ = ["SocketChannels", "address_key", "local_address"]

_LOG = logging.getLogger("sbpflow.comm")
_STORE = b"store"  # the published address of a process that reads the store's queues
_CHUNK = 1 << 18  # bytes a frame must reach to be written part by part (no copy)


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
        self._receiver: Receiver | None = None
        try:
            if force_store:
                raise OSError("SBPFLOW_CHANNELS=store")
            self._receiver = Receiver(rank, local_address(store), self.secret)
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
            address = self._published(src, dst, channel)
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
            sock.sendall(b"".join(encode(self.rank, RING_OFFER, (ring.pid, ring.fd, capacity))))
            sock.settimeout(HANDSHAKE_S)
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

    def _published(self, src: int, dst: int, channel: str) -> bytes:
        """``dst``'s published address (`CommError` naming ``src``, ``dst`` and ``channel``
        when the store has none within its timeout)."""
        try:
            return self._store.get(address_key(dst))
        except (RuntimeError, OSError) as exc:
            raise _error(src, dst, channel, f"its address was not published in the store "
                         f"within {self.timeout:g} s", exc) from exc

    def same_host(self, peer: int) -> bool:
        """Whether ``peer`` listens for channels on this process's host, as this process does
        (its published address; waited for as a post waits): both ends answer alike."""
        if self._receiver is None:
            return False
        address = self._published(self.rank, peer, "(point-to-point)")
        return address != _STORE and address.decode().rsplit(":", 1)[0] == self._receiver.host

    def connected_from(self, src: int) -> bool:
        """False once the last connection from rank ``src`` closed (its process ended or closed
        its channels) and none reopened."""
        return self._receiver is None or src not in self._receiver.closed_from

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

    def lead(self, timeout: float | None) -> bool:
        """Wait on the calling thread, up to ``timeout`` s, for frames or `wake_leader`, and
        hand over what arrived as the receiver thread would (which meanwhile does not watch
        the connections): the frames' consumer is woken by the kernel itself, not by the
        receiver thread. False at once when another thread leads or this transport cannot."""
        return self._receiver is not None and self._receiver.lead(timeout)

    def wake_leader(self) -> None:
        """End the leading thread's wait (`lead`) now."""
        if self._receiver is not None:
            self._receiver.wake_leader()

    def lead_end(self) -> None:
        """The leading thread waits no more for now: the receiver thread reads at once."""
        if self._receiver is not None:
            self._receiver.take_back(now=True)

    @property
    def leads(self) -> bool:
        """Whether `lead` can work here (Linux's epoll and eventfd, a socket receiver)."""
        return LEADS and self._receiver is not None

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
        body = encode_any(message)
        views = body[1]
        if self.ring is not None and views and sum(v.nbytes for v in views) >= RING_MIN:
            with self.lock:
                pos = self.ring.place(views)
                if pos is not None:
                    self.sock.sendall(ring_frame(src, channel, body[0], views, pos, body[2]))
                else:
                    self._write(encode(src, channel, message, body))
            return
        parts = encode(src, channel, message, body)
        with self.lock:
            if len(parts) == 1:  # (a req or an ack: one small bytes object)
                self.sock.sendall(parts[0])
            else:
                self._write(parts)

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
