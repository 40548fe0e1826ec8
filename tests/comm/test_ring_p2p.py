"""Same-host send / recv through the message channels and their shared-memory ring
(sbpflow/comm/ring_p2p.py; SBPFLOW_P2P_RING=1, else gloo): values equal what was sent, the byte
counters as gloo's, a message too large for the ring goes through gloo in the same exchange,
and a silent or departed sender ends a receive with the backend's errors."""

import time

import pytest
import torch

from ring_p2p_fns import ping_pong, silent_peer
from sbpflow.comm import launch
from sbpflow.comm.ring_p2p import RingP2P
from sbpflow.comm.socket_channels import SocketChannels
from sbpflow.errors import CommError

SIZES = [1, 5000, 300_000]  # float32s: inline frame, ring, over half of a 1 MiB ring (gloo)


@pytest.mark.gloo
@pytest.mark.parametrize("on", ["1", "0", None])
def test_send_recv_and_exchange_move_the_values_by_ring_or_gloo(monkeypatch, on):
    monkeypatch.setenv("SBPFLOW_SHM_RING_MB", "1")
    if on is None:  # the default: gloo
        monkeypatch.delenv("SBPFLOW_P2P_RING", raising=False)
    else:
        monkeypatch.setenv("SBPFLOW_P2P_RING", on)
    r0, r1 = launch(ping_pong, 2, backend="torch", args=(SIZES,))
    want = [True, True, False] if on == "1" else [False] * 3
    assert r0[0] == r1[0] == want
    moved = 4 * (sum(SIZES) + SIZES[1] + SIZES[-1])
    assert r0[1] == r1[1] == (moved, moved)
    assert r0[2] is (on == "1")


def test_a_receive_ends_when_its_senders_connection_closes_and_checks_its_shape(store,
                                                                               monkeypatch):
    monkeypatch.setenv("SBPFLOW_P2P_RING", "1")
    a, b = SocketChannels(0, store, 10.0), SocketChannels(1, store, 10.0)
    pa, pb = RingP2P(0, lambda: a, 30.0), RingP2P(1, lambda: b, 30.0)
    assert pa.takes(1, 4000) and pb.takes(0, 4000) and not pa.takes(0, 4000)
    x = torch.arange(1000.0)
    for want in (x, x[:10]):
        pb.send(0, want)
    got = pa.receive(1, (1000,), torch.float32, torch.device("cpu"))
    got.wait()
    assert torch.equal(got.result, x)
    with pytest.raises(CommError, match=r"expected a torch.float32 tensor of shape \(1000,\) "
                                        r"from rank 1, got a torch.float32 tensor of shape"):
        pa.receive(1, (1000,), torch.float32, torch.device("cpu")).wait()
    b.close()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="closed"):
        pa.receive(1, (1000,), torch.float32, torch.device("cpu")).wait()
    assert time.monotonic() - t0 < 5
    a.close()


@pytest.mark.gloo
def test_a_receive_from_a_silent_sender_times_out_naming_it(monkeypatch):
    monkeypatch.setenv("SBPFLOW_TIMEOUT", "3")
    monkeypatch.setenv("SBPFLOW_P2P_RING", "1")
    r0, r1 = launch(silent_peer, 2, backend="torch", args=(5000,), timeout=3.0)
    kind, text, culprits = r1.split("|")
    assert r0 == "slept" and kind == "CommTimeout", r1
    assert "exchange with ranks [0] timed out on rank 1 after 3 s" in text, text
    assert "rank 0" in text and culprits == "(0,)", r1
