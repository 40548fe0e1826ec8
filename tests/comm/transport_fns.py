"""Rank functions of the transport-security tests on gloo processes (module level: the
processes import them)."""

from __future__ import annotations

import os

from transport_probe import tcp_sockets


def sockets_of_a_one_host_world(launcher: int) -> dict:
    """On every rank of a gloo world: a boxing (gloo pairs), a message to the other rank (its
    channel connection), then the TCP sockets of this process and of the launcher."""
    import sbpflow as sf
    x = sf.randn(8, 4, placement=sf.placement("cpu", ranks=[0, 1]), sbp=sf.S(0))
    x.to_global(sbp=sf.B)
    comm = sf.comm.current()
    comm.post(1 - sf.rank(), "probe", ("hello", sf.rank()))
    got = []
    while not got:
        got = comm.inbox("probe", 1.0)
    comm.barrier()
    return {"mine": tcp_sockets(os.getpid()), "launcher": tcp_sockets(launcher), "got": got}
