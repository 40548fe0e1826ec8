"""Socket message channels of the torch backend (sbpflow/comm/socket_channels.py): two or more
'ranks' in this process on a local TCPStore (docs/runtime.md 'Message channels'); on gloo
processes, `gloo_fns.collectives_fn` posts a ring."""

import threading
import time

import pytest
import torch

from channel_fns import take_all
from sbpflow.comm.socket_channels import SocketChannels, address_key
from sbpflow.errors import CommError


def test_socket_channels_keep_each_senders_order_from_many_threads(store):
    chans = [SocketChannels(r, store, 10.0) for r in range(3)]
    assert [c.transport for c in chans] == ["socket"] * 3
    assert store.get(address_key(2)).decode().startswith("127.0.0.1:")

    def sender(src, thread):  # two threads a sender: each thread's own posts keep their order
        for k in range(200):
            chans[src].post(src, 2, "c", (thread, k))

    threads = [threading.Thread(target=sender, args=(src, (src, t)))
               for src in (0, 1) for t in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    got = take_all(chans[2], 2, 800)
    assert len(got) == 800
    for src in (0, 1):
        for t in range(2):
            assert [m[1] for s, m in got if s == src and m[0] == (src, t)] == list(range(200))
    assert chans[2].take(2, "c", 0.0, lambda: None) == []
    [c.close() for c in chans]


def test_many_channels_and_a_message_to_itself(store):
    a, b = SocketChannels(0, store, 10.0), SocketChannels(1, store, 10.0)
    for k in range(50):
        a.post(0, 1, f"ch{k}", ("req", k))
    t = torch.arange(3.0)
    b.post(1, 1, "ch7", ("self", t))
    t.add_(1)  # a post copies: the receiver sees the tensor as posted
    for k in range(50):
        got = sorted(take_all(b, 1, 2 if k == 7 else 1, f"ch{k}"), key=lambda g: g[0])
        assert got[0] == (0, ("req", k)) and len(got) == (2 if k == 7 else 1)
        if k == 7:  # (the order across senders is free: the self-post may come first)
            assert got[1][0] == 1 and torch.equal(got[1][1][1], torch.arange(3.0))
    a.close(), b.close()


def test_a_large_message_arrives_whole_beside_small_ones(store):
    a, b = SocketChannels(0, store, 10.0), SocketChannels(1, store, 10.0)
    big = torch.randn(3_000_000, generator=torch.Generator().manual_seed(0))  # 12 MB
    a.post(0, 1, "c", ("small", 0))
    a.post(0, 1, "c", ("big", big))
    a.post(0, 1, "c", ("small", 1))
    got = take_all(b, 1, 3)
    assert [m[0] for _, m in got] == ["small", "big", "small"]
    assert torch.equal(got[1][1][1], big)
    a.close(), b.close()


def test_take_waits_at_most_its_timeout_and_wakes_on_a_post(store):
    a, b = SocketChannels(0, store, 10.0), SocketChannels(1, store, 10.0)
    t0 = time.monotonic()
    assert b.take(1, "c", 0.2, lambda: None) == []
    assert 0.15 < time.monotonic() - t0 < 2.0
    threading.Timer(0.1, a.post, args=(0, 1, "c", "hello")).start()
    t0 = time.monotonic()
    assert b.take(1, "c", 30.0, lambda: None) == [(0, "hello")]
    assert time.monotonic() - t0 < 10.0  # woken by the post, not the 30 s timeout
    a.close(), b.close()


def test_a_peer_gone_is_a_comm_error_naming_src_dst_and_channel(store):
    a, b, c = (SocketChannels(r, store, 10.0) for r in range(3))
    a.post(0, 1, "c", "first")  # a connection to rank 1 exists
    assert take_all(b, 1, 1) == [(0, "first")]
    b.close(), c.close()
    with pytest.raises(CommError, match=r"post from rank 0 to rank 2 on message channel 'x': "
                                        r"connecting to 127\.0\.0\.1:\d+ failed"):
        a.post(0, 2, "x", "never opened")  # refused: nobody listens any more
    with pytest.raises(CommError, match=r"post from rank 0 to rank 1 on message channel 'c': "
                                        r"sending to 127\.0\.0\.1:\d+ failed"):
        for _ in range(1000):  # the first send after the close may still reach the kernel
            a.post(0, 1, "c", "after")
            time.sleep(0.005)
    a.close()


def test_an_unpublished_peer_is_a_comm_error_after_the_timeout(store):
    a = SocketChannels(0, store, 0.3)
    with pytest.raises(CommError, match=r"post from rank 0 to rank 5 on message channel 'c': "
                                        r"its address was not published in the store within "
                                        r"0\.3 s"):
        a.post(0, 5, "c", "x")
    a.close()


def test_a_rank_on_the_store_fallback_and_a_socket_rank_talk_both_ways(store):
    a, b = SocketChannels(0, store, 10.0), SocketChannels(1, store, 10.0, force_store=True)
    assert (a.transport, b.transport) == ("socket", "store")
    for k in range(5):
        a.post(0, 1, "c", k)
        b.post(1, 0, "c", -k)
    assert take_all(b, 1, 5) == [(0, k) for k in range(5)]
    assert take_all(a, 0, 5) == [(1, -k) for k in range(5)]
    a.close(), b.close()


def test_close_stops_the_receiver_thread_and_sockets(store):
    before = set(threading.enumerate())
    a, b = SocketChannels(0, store, 10.0), SocketChannels(1, store, 10.0)
    a.post(0, 1, "c", 1)
    assert take_all(b, 1, 1) == [(0, 1)]
    assert len(set(threading.enumerate()) - before) == 2
    a.close(), b.close()
    assert set(threading.enumerate()) - before == set()
