"""What the transport trusts (docs/runtime.md 'What the transport trusts'): message channels run
no code sent to them, read frames only from peers that proved they hold the world's secret,
drop what does not parse and go on; the store fallback accepts only sealed frames; a one-host
world's sockets are all on loopback. In-process 'ranks' on a local store, then gloo processes."""

import logging
import os
import pickle
import socket
import time

import pytest
import torch

import sbpflow as sf
from channel_fns import take_all
from sbpflow.comm.auth import client_handshake
from sbpflow.comm.channels import StoreChannels
from sbpflow.comm.socket_channels import SocketChannels, address_key
from sbpflow.comm.wire import PREFIX, encode
from sbpflow.errors import CommError, WireError
from transport_fns import sockets_of_a_one_host_world
from transport_probe import Planted, is_loopback, payloads, send_as_stranger, tcp_sockets


def _address(store, rank):
    host, port = store.get(address_key(rank)).decode().rsplit(":", 1)
    return host, int(port)


def _wait_dropped(chan, n, seconds=10.0):
    deadline = time.monotonic() + seconds
    while chan._receiver.dropped < n and time.monotonic() < deadline:
        time.sleep(0.01)
    return chan._receiver.dropped


def test_a_strangers_pickle_and_garbage_run_nothing_and_the_channels_go_on(store, tmp_path,
                                                                           caplog):
    a, b = SocketChannels(0, store, 10.0), SocketChannels(1, store, 10.0)
    a.post(0, 1, "c", "before")
    planted = tmp_path / "planted"
    caplog.set_level(logging.WARNING, logger="sbpflow.comm")
    for data in payloads(str(planted)):
        send_as_stranger(*_address(store, 1), data)
    assert _wait_dropped(b, 3) == 3
    a.post(0, 1, "c", ("after", torch.arange(3.0)))
    got = take_all(b, 1, 2)
    assert got[0] == (0, "before") and got[1][1][0] == "after"
    assert torch.equal(got[1][1][1], torch.arange(3.0))
    assert not planted.exists()
    drops = [r.getMessage() for r in caplog.records if "dropped the message connection" in
             r.getMessage()]
    assert len(drops) == 3 and all("from 127.0.0.1:" in m for m in drops)
    assert all("did not prove it holds the world's secret" in m for m in drops[:1])
    a.close(), b.close()


def test_a_frame_that_names_a_function_is_dropped_even_from_a_peer_with_the_secret(store,
                                                                                   tmp_path):
    a, b = SocketChannels(0, store, 10.0), SocketChannels(1, store, 10.0)
    planted = tmp_path / "planted"
    body = pickle.dumps(Planted(str(planted)), protocol=5)
    name = b"c"
    frame = PREFIX.pack(len(name) + len(body), len(body), 0, len(name), 0) + name + body
    with socket.create_connection(_address(store, 1), timeout=5) as sock:
        client_handshake(sock, a.secret)  # a peer of the world: its frames are read
        sock.sendall(frame)
        assert _wait_dropped(b, 1) == 1
        assert sock.recv(10) == b""  # the receiver closed the connection
    assert not planted.exists()
    a.post(0, 1, "c", "still up")
    assert take_all(b, 1, 1) == [(0, "still up")]
    a.close(), b.close()


def test_a_half_finished_handshake_is_dropped_after_its_deadline(store, monkeypatch):
    monkeypatch.setattr("sbpflow.comm.receiver.HANDSHAKE_S", 0.2)
    b = SocketChannels(1, store, 10.0, secret=b"world")
    with socket.create_connection(_address(store, 1), timeout=5) as sock:
        sock.recv(41)  # the challenge, never answered
        assert _wait_dropped(b, 1, 5.0) == 1
        assert sock.recv(10) == b""
    b.close()


def test_a_peer_with_another_secret_is_refused_both_ways(store):
    a, b = SocketChannels(0, store, 10.0), SocketChannels(1, store, 10.0)
    stranger = SocketChannels(2, store, 10.0, secret=b"not the world's secret")
    with pytest.raises(CommError, match=r"post from rank 2 to rank 1 on message channel 'c': "
                                        r"authenticating with 127\.0\.0\.1:\d+ \(is "
                                        r"SBPFLOW_SECRET the same on every rank\?\) failed"):
        stranger.post(2, 1, "c", "let me in")
    with pytest.raises(CommError, match="authenticating with"):  # it does not talk to strangers
        a.post(0, 2, "c", "secret activations")
    assert b.take(1, "c", 0.2, lambda: None) == []
    assert stranger.take(2, "c", 0.2, lambda: None) == []
    a.close(), b.close(), stranger.close()


def test_the_worlds_secret_is_the_environments_else_rank_zeros(store, monkeypatch):
    a, b = SocketChannels(0, store, 10.0), SocketChannels(1, store, 10.0)
    assert a.secret == b.secret and len(a.secret) == 64  # rank 0's random one, through the store
    again = SocketChannels(0, store, 10.0)  # a second communicator of rank 0 keeps it
    assert again.secret == a.secret
    a.close(), b.close(), again.close()
    monkeypatch.setenv("SBPFLOW_SECRET", "from the launcher")
    c = SocketChannels(0, store, 10.0)
    assert c.secret == b"from the launcher"
    c.close()


def test_a_message_that_is_not_plain_data_is_refused_at_the_sender(store):
    a, b = SocketChannels(0, store, 10.0), SocketChannels(1, store, 10.0)
    with pytest.raises(WireError, match=r"plain data and tensors only, not "
                                        r"transport_probe\.Planted"):
        a.post(0, 1, "c", ("req", Planted("/nowhere")))
    a.post(0, 1, "c", "next")
    assert take_all(b, 1, 1) == [(0, "next")]
    a.close(), b.close()


def test_the_store_fallback_drops_what_is_not_sealed_with_the_secret(store, tmp_path, caplog):
    secret = b"world"
    a, b = StoreChannels(0, store, secret), StoreChannels(1, store, secret)
    assert b.take(1, "c", 0.0, lambda: None) == []  # its reader runs
    planted = tmp_path / "planted"
    caplog.set_level(logging.WARNING, logger="sbpflow.comm")
    key = StoreChannels.key(1, "c")
    store.queue_push(key, pickle.dumps((0, Planted(str(planted)))))  # the old format
    store.queue_push(key, os.urandom(100))
    forged = b"".join(encode(0, "c", "forged"))
    store.queue_push(key, b"\0" * 32 + forged)  # a frame with a wrong tag
    a.post(0, 1, "c", ("sealed", torch.ones(2)))
    got = take_all(b, 1, 1)
    assert len(got) == 1 and got[0][1][0] == "sealed" and torch.equal(got[0][1][1], torch.ones(2))
    assert not planted.exists()
    assert sum("dropped a message of store queue" in r.getMessage()
               for r in caplog.records) == 3
    a.close(), b.close()


@pytest.mark.gloo
def test_a_one_host_world_opens_only_loopback_sockets():
    res = sf.launch(sockets_of_a_one_host_world, world_size=2, backend="torch",
                    args=(os.getpid(),))
    assert [r["got"] for r in res] == [[(1, ("hello", 1))], [(0, ("hello", 0))]]
    for r in res:
        assert len(r["mine"]) >= 4 and any(state == "0A" for _, _, state in r["mine"])
        for who in ("mine", "launcher"):
            bad = [s for s in r[who] if not is_loopback(s[0], s[1])]
            assert bad == [], f"{who}: sockets beyond loopback {bad}"
    # the launcher's store listens (0A) on loopback; nothing is left open after the launch
    assert any(state == "0A" for _, _, state in res[0]["launcher"])
    assert [s for s in tcp_sockets(os.getpid()) if s[2] == "0A"] == []
