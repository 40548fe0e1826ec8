"""Rank functions of tests/comm/test_ring_p2p.py: point-to-point messages between two rank
processes of one host, through the message channels' ring or gloo by their size."""

import os
import time

import torch

import sbpflow as sf


def _value(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def ping_pong(sizes: list) -> list:
    """Rank 0 sends each size to rank 1, which sends it back plus one (send / recv), then both
    exchange a ringed and a gloo-sized message at once each way (`exchange`). Returns per
    message whether it went through the channels (`RingP2P.takes`), the p2p byte counters, and
    whether rank 0's receives read the channel (its pending queue for rank 1 exists)."""
    comm = sf.comm.current()
    peer = 1 - comm.rank
    ways = []
    for i, n in enumerate(sizes):
        ways.append(comm._p2p.takes(peer, 4 * n))
        if comm.rank == 0:
            x = _value(n, i)
            comm.send(x, 1)
            back = comm.recv((n,), torch.float32, 1)
            assert torch.equal(back, x + 1), (n, back[:4], x[:4])
        else:
            got = comm.recv((n,), torch.float32, 0)
            comm.send(got + 1, 0)
    small, big = sizes[1], sizes[-1]
    mine = [_value(small, 100 + comm.rank), _value(big, 200 + comm.rank)]
    got = comm.exchange([(peer, mine[0]), (peer, mine[1])],
                        [(peer, (small,), torch.float32), (peer, (big,), torch.float32)])
    assert torch.equal(got[0], _value(small, 100 + peer))
    assert torch.equal(got[1], _value(big, 200 + peer))
    stats = comm.stats()["p2p"]
    return [ways, (stats.sent, stats.recv), peer in comm._p2p._pending]


def silent_peer(n: int) -> str:
    """Rank 1 receives from rank 0, which never sends: the receive times out naming rank 0."""
    comm = sf.comm.current()
    if comm.rank == 0:
        time.sleep(float(os.environ["SBPFLOW_TIMEOUT"]) + 3)
        return "slept"
    try:
        comm.recv((n,), torch.float32, 0)
    except sf.CommError as exc:
        return f"{type(exc).__name__}|{exc}|{getattr(exc, 'culprits', ())}"
    return "received"
