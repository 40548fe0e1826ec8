"""The receiving side of a process's socket message channels: one listening socket, the
connections peers opened to it, and the thread that reads them.

A connection is read for frames only after it proved it holds the world's secret (`auth`,
within `HANDSHAKE_S`); a frame that does not parse drops it with a warning. Frames go into
per-channel deques (`Receiver.take`) or to a listener (`Receiver.listen`, the runtime's
channels); a sender's ring offer (`RING_OFFER`) is mapped here (`shm_ring`). The authenticated
connections are watched through one epoll that a waiting consumer thread may take from the
receiver thread (`Receiver.lead`: then the kernel wakes the consumer itself, one wake-up a
message); the receiver thread takes it back at the leader's `take_back`, or `HOLD_S` after
the leader's last wait. One reader at a time (a lock), so frames stay in order whichever thread
reads. See docs/runtime.md, 'Message channels'.
"""

from __future__ import annotations

import logging
import os
import select
import selectors
import socket
import threading
import time
from collections import deque
from typing import Any, Callable

from ..errors import CommError, WireError
from .auth import ServerHandshake
from .shm_ring import Ring
from .spin import spin_budget, spin_poll
from .wire import FrameReader

__all__ = ["Receiver", "RING_OFFER", "HANDSHAKE_S", "LEADS"]

_LOG = logging.getLogger("sbpflow.comm")
_CHUNK = 1 << 18  # bytes a recv asks for
HANDSHAKE_S = 10.0  # s a new connection has to prove it belongs to the world
RING_OFFER = "\x00sbpflow/ring"  # the channel of a sender's ring offer (`shm_ring`)
LEADS = hasattr(select, "epoll") and hasattr(os, "eventfd")  # `Receiver.lead` can work
HOLD_S = 0.01  # s a leader keeps the connections from the receiver thread after its wait
_READY = object()  # the selector key data of the authenticated connections' epoll
_NUDGE = object()  # the selector key data of the receiver thread's nudge (a leader took over)


class _Conn:
    """An accepted connection: its address, its handshake until the peer proved it holds the
    secret (then None), and the frames it sends."""

    def __init__(self, sock: socket.socket, address: str, secret: bytes) -> None:
        self.sock, self.address = sock, address
        self.handshake: ServerHandshake | None = ServerHandshake(secret)
        self.since = time.monotonic()
        self.frames = FrameReader()
        self.src: int | None = None  # the rank its frames come from (once one came)


class _Listener:
    """Where a listened channel's items go (`Receiver.listen`); ``order`` keeps them in
    arrival order."""

    def __init__(self, deliver: Callable[[list], None],
                 failed: Callable[[BaseException], None]) -> None:
        self.deliver, self.failed = deliver, failed
        self.order = threading.Lock()


class Receiver:
    """The listening socket and the thread that reads every incoming connection into
    per-channel deques (one lock; a condition a channel, so a frame wakes only its taker) or
    listeners. Only connections that proved they hold ``secret`` are read for frames; those
    are watched through one epoll (``_ready``), which a leading thread (`lead`) takes from the
    receiver thread's selector while it waits. One reader of the connections at a time
    (``_read_lock``), so a connection's frames stay in order whichever thread reads."""

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
        self.closed_from: set[int] = set()  # ranks whose last connection closed (`_close`)
        self._pending: set[_Conn] = set()  # accepted, not yet authenticated
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.listener, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._sel_lock = threading.Lock()  # the selector's registrations (two threads edit)
        self._read_lock = threading.Lock()  # one reader of the connections at a time
        self._conns: dict[int, _Conn] = {}  # authenticated connections by fd (in ``_ready``)
        self._lead_lock = threading.Lock()  # one leading thread at a time
        self._spin = spin_budget()  # s a leader polls before it blocks (`spin`)
        if LEADS:
            self._ready = select.epoll()
            self._sel.register(self._ready, selectors.EVENT_READ, _READY)
            self._bell = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)  # `wake_leader`
            self._lead_ep = select.epoll()  # what a leader waits on: the connections, the bell
            self._lead_ep.register(self._ready.fileno(), select.EPOLLIN)
            self._lead_ep.register(self._bell, select.EPOLLIN)
            self._nudge = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)  # (`lead`)
            self._sel.register(self._nudge, selectors.EVENT_READ, _NUDGE)
        self._stopped = False
        self._held = self._leading = False  # a leader holds the connections / waits on them
        self._left = 0.0  # when the last leader's wait ended (time.monotonic)
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
                # a connection still proving itself has HANDSHAKE_S; look again within 1 s;
                # a leader holding the connections, within HOLD_S
                wait = HOLD_S if self._held else 1.0 if self._pending else None
                for key, _ in self._sel.select(wait):
                    if key.fileobj is self._wake_r:
                        return
                    if key.fileobj is self.listener:
                        self._accept()
                    elif key.data is _READY:
                        self._read_ready()
                    elif key.data is _NUDGE:
                        os.eventfd_read(self._nudge)
                    else:
                        with self._read_lock:
                            self._read(key.data)
                self._expire()
                if self._held:
                    self.take_back()
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
        with self._sel_lock:
            self._sel.register(sock, selectors.EVENT_READ, conn)

    def _read_ready(self) -> None:
        """Read the authenticated connections that have bytes (either thread)."""
        with self._read_lock:
            for fd, _ in self._ready.poll(0):
                conn = self._conns.get(fd)
                if conn is not None:
                    self._read(conn)

    def lead(self, timeout: float | None) -> bool:
        """`SocketChannels.lead` (one thread at a time; False when another leads). The leader
        keeps the connections from the receiver thread after its wait too (its next wait
        needs no hand-over); the receiver thread takes them back once no leader waited for
        `HOLD_S` (a long kernel: an abort is read within that)."""
        if not LEADS or self._stopped or not self._lead_lock.acquire(blocking=False):
            return False
        try:
            with self._sel_lock:
                if self._stopped:
                    return False
                if not self._held:  # the receiver thread then waits HOLD_S at most
                    self._sel.unregister(self._ready)
                    self._held = True
                    os.eventfd_write(self._nudge, 1)
                self._leading = True
            try:
                # (a spin first: a message that comes soon costs no wake-up, `spin`)
                spin = self._spin if timeout is None else min(self._spin, timeout)
                events = spin_poll(self._poll_now, spin)
                if not events:
                    events = self._lead_ep.poll(-1 if timeout is None else timeout)
                for fd, _ in events:
                    if fd == self._bell:
                        os.eventfd_read(self._bell)
                if events:
                    self._read_ready()
            finally:
                self._left, self._leading = time.monotonic(), False
        finally:
            self._lead_lock.release()
        return True

    def _poll_now(self) -> list:
        return self._lead_ep.poll(0)

    def take_back(self, now: bool = False) -> None:
        """The receiver thread watches the connections again if no leader waits and (unless
        ``now``) none has waited for `HOLD_S`."""
        with self._sel_lock:
            if self._held and not self._leading and not self._stopped \
                    and (now or time.monotonic() - self._left > HOLD_S):
                self._sel.register(self._ready, selectors.EVENT_READ, _READY)
                self._held = False

    def wake_leader(self) -> None:
        if LEADS and not self._stopped:
            os.eventfd_write(self._bell, 1)

    def _authenticated(self, conn: _Conn) -> None:
        """Move ``conn`` from the selector to the connections' epoll (read lock held)."""
        self._pending.discard(conn)
        if not LEADS:
            return
        with self._sel_lock:
            self._sel.unregister(conn.sock)
        self._conns[conn.sock.fileno()] = conn
        self._ready.register(conn.sock.fileno(), select.EPOLLIN)

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
                self._authenticated(conn)
            for src, channel, message in conn.frames.feed(data):
                if conn.src != src:  # (a new connection of a rank: it is back)
                    conn.src = src
                    self.closed_from.discard(src)
                if channel == RING_OFFER:
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
        if conn.src is not None:
            with self._lock:  # (a receive from that rank waits no more: `connected_from`)
                self.closed_from.add(conn.src)
                for _, cond in self._boxes.values():
                    cond.notify_all()
        self._pending.discard(conn)
        if self._conns.pop(conn.sock.fileno(), None) is not None:
            self._ready.unregister(conn.sock.fileno())
        else:
            with self._sel_lock:
                self._sel.unregister(conn.sock)
        conn.sock.close()
        if conn.frames.ring is not None:
            conn.frames.ring.close()

    def _expire(self) -> None:
        """Drop the connections that have not proved themselves within `HANDSHAKE_S`."""
        now = time.monotonic()
        for conn in [c for c in self._pending if now - c.since > HANDSHAKE_S]:
            self._drop(conn, f"no proof of the world's secret within {HANDSHAKE_S:g} s")

    def _shut(self) -> None:
        with self._sel_lock:
            self._stopped = True
            keys = list(self._sel.get_map().values())
        if LEADS:
            os.eventfd_write(self._bell, 1)  # a leader's wait ends; it leads no more
        with self._lead_lock:
            conns = [k.data for k in keys if isinstance(k.data, _Conn)]
            conns += list(self._conns.values())
            for conn in conns:
                conn.sock.close()
                if conn.frames.ring is not None:
                    conn.frames.ring.close()
            for key in keys:
                if isinstance(key.fileobj, int):
                    os.close(key.fileobj)
                elif not isinstance(key.data, _Conn):
                    key.fileobj.close()
            self._sel.close()
            if LEADS:
                self._ready.close()
                self._lead_ep.close()
                os.close(self._bell)

    def stop(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self.thread.join(5.0)
        self._wake_w.close()
