"""Message channels (sbpflow/comm/channels.py): the c10d-store channels of the torch backend
on a local TCPStore, two 'ranks' in this process (docs/runtime.md 'Message channels'); the
threads backend's are exercised in tests/runtime/test_runtime_ranks.py."""

import threading
import time
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist

from channel_fns import take_all
from sbpflow.comm.channels import StoreChannels, copy_tensors, tensor_bytes
from sbpflow.errors import CommError

SECRET = b"a test world's secret"


def test_store_channels_deliver_in_order_with_tensors(store):
    a, b = StoreChannels(0, store, SECRET), StoreChannels(1, store, SECRET)
    t = torch.arange(6.0)
    for k in range(20):
        a.post(0, 1, "c", ("req", k, t * k))
    got = take_all(b, 1, 20)
    assert [src for src, _ in got] == [0] * 20
    assert [m[1] for _, m in got] == list(range(20))
    assert all(torch.equal(m[2], t * m[1]) for _, m in got)
    assert b.take(1, "c", 0.0, lambda: None) == []
    a.close(), b.close()


def test_store_channel_take_waits_at_most_its_timeout_and_wakes_on_a_post(store):
    a, b = StoreChannels(0, store, SECRET), StoreChannels(1, store, SECRET)
    t0 = time.monotonic()
    assert b.take(1, "c", 0.2, lambda: None) == []
    assert 0.15 < time.monotonic() - t0 < 2.0
    threading.Timer(0.1, a.post, args=(0, 1, "c", "hello")).start()
    t0 = time.monotonic()
    assert b.take(1, "c", 30.0, lambda: None) == [(0, "hello")]
    assert time.monotonic() - t0 < 10.0  # woken by the post (0.1 s), not the 30 s timeout
    a.close(), b.close()


def test_store_channels_close_stops_the_reader_threads(store):
    before = set(threading.enumerate())
    b = StoreChannels(1, store, SECRET)
    b.take(1, "x", 0.0, lambda: None)
    b.take(1, "y", 0.0, lambda: None)
    assert len(set(threading.enumerate()) - before) == 2
    b.close()
    assert set(threading.enumerate()) - before == set()


def test_a_reader_whose_store_died_raises_comm_error():
    s = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", s.port, 1, is_master=False)
    b = StoreChannels(1, client, SECRET)
    b.take(1, "c", 0.0, lambda: None)
    del s  # the server goes away under the blocked reader
    with pytest.raises(CommError, match="message channel 'sbpflow/channel/c/1': the c10d "
                                        "store failed"):
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            b.take(1, "c", 0.2, lambda: None)


class _Pair(NamedTuple):
    value: torch.Tensor
    label: int


def test_copy_and_count_tensors_in_messages():
    t = torch.ones(3, dtype=torch.float64)
    msg = ("req", 1, {"x": t, "y": [t, 2]})
    c = copy_tensors(msg)
    t.add_(1)
    assert torch.equal(c[2]["x"], torch.ones(3, dtype=torch.float64)) and c[2]["y"][1] == 2
    assert tensor_bytes(msg) == 2 * 3 * 8 and tensor_bytes(("wake", 3)) == 0
    pair = _Pair(t, 2)                     # a namedtuple stays one (it raised a TypeError)
    copied = copy_tensors(pair)
    assert type(copied) is _Pair and copied.label == 2 and copied.value is not t
    assert torch.equal(copied.value, t)


def test_a_store_failure_in_post_is_a_comm_error():
    """A dead store (DistNetworkError, a RuntimeError) raises CommError from post, which the
    runtime handles as every communication failure (not a bare RuntimeError)."""
    class DeadStore:
        def queue_push(self, key, data):
            raise dist.DistNetworkError("Broken pipe")

    ch = StoreChannels(0, DeadStore(), SECRET)
    with pytest.raises(CommError, match=r"post from rank 0 to rank 1 on message channel 'c': "
                                        r"the c10d store failed: DistNetworkError: Broken pipe"):
        ch.post(0, 1, "c", ("req", 1))
