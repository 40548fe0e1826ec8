"""The shared-memory ring of same-host message channels (sbpflow/comm/shm_ring.py) and its
frames (wire.IN_RING): records wrap and come back whole, and a frame or an offer that names
anything but the unread part of a ring of this user is a `WireError` (the receiver then drops
the connection, as for any frame that does not parse)."""

import os

import pytest
import torch

from sbpflow.comm.shm_ring import Ring
from sbpflow.comm.wire import FrameReader, encode_body, ring_frame
from sbpflow.errors import WireError


def _views(*sizes):
    return [memoryview(bytes([k % 251]) * n) for k, n in enumerate(sizes)]


def test_records_wrap_and_are_read_whole_then_freed():
    sender = Ring.create(1000)
    receiver = Ring.open(os.getpid(), sender.fd, 1000)
    for k in range(30):  # 30 records of 300 + 150 bytes through 1000: wraps again and again
        views = [memoryview(bytes([k]) * 300), memoryview(bytes([k + 1]) * 150)]
        pos = sender.place(views)
        assert pos is not None and pos % 1000 + 450 <= 1000
        assert sender.place(_views(600)) is None  # the unread record leaves no room for it
        got = receiver.read(pos, [300, 150])
        assert [bytes(g) for g in got] == [bytes(v) for v in views]
        [g.release() for g in got]
        receiver.free()
    receiver.close(), sender.close()


def test_a_frame_outside_the_unread_part_is_refused():
    sender = Ring.create(1000)
    receiver = Ring.open(os.getpid(), sender.fd, 1000)
    pos = sender.place(_views(400))
    for bad, sizes in [(pos, [1001]), (pos + 700, [400]), (-1 % (1 << 64), [4])]:
        with pytest.raises(WireError):
            receiver.read(bad, sizes)
    receiver.read(pos, [400])
    receiver.free()
    with pytest.raises(WireError):  # freed: read again, it is behind the tail
        receiver.read(pos, [400])
    receiver.close(), sender.close()


def test_ring_frames_decode_on_a_connection_with_the_ring_only():
    sender = Ring.create(1 << 20)
    x = torch.randn(5000, generator=torch.Generator().manual_seed(0))
    body, views = encode_body(("req", x))
    frame = ring_frame(3, "c", body, views, sender.place(views))
    plain = FrameReader()
    assert plain.feed(frame) == [] and isinstance(plain.error, WireError)
    reader = FrameReader()
    reader.ring = Ring.open(os.getpid(), sender.fd, 1 << 20)
    [(src, channel, (kind, got))] = reader.feed(frame)
    assert (src, channel, kind) == (3, "c", "req") and torch.equal(got, x)
    reader.ring.close(), sender.close()


def test_an_offer_that_is_no_ring_is_declined(tmp_path):
    sender = Ring.create(4096)
    for pid, fd, capacity in [(os.getpid(), sender.fd, 8192), (os.getpid(), 10 ** 6, 4096),
                              (0, sender.fd, 4096), (os.getpid(), sender.fd, -1)]:
        with pytest.raises(WireError):
            Ring.open(pid, fd, capacity)
    path = tmp_path / "f"
    path.write_bytes(b"\0" * (4096 + 4096))  # the right size, no ring's magic
    fd = os.open(path, os.O_RDWR)
    try:
        with pytest.raises(WireError):
            Ring.open(os.getpid(), fd, 4096)
    finally:
        os.close(fd)
    sender.close()
