"""A one-host world that exposes nothing beyond loopback: what `sf.launch(backend="torch")` and
``sbpflow run --backend torch`` give their rank processes.

The launcher hosts the c10d store on a socket bound to 127.0.0.1 (torch's ``TCPStore`` would
listen on every interface), gives each rank torchrun's variables for that store, a fresh world
secret (`auth`: the message channels' handshake) and ``GLOO_SOCKET_IFNAME`` of the loopback
interface, so gloo's pairs bind there too; the message channels bind to the interface that
reaches the store's host, loopback again. See docs/runtime.md, 'What the transport trusts'.
"""

from __future__ import annotations

import datetime
import fcntl
import socket
import struct

import torch.distributed as dist

from .auth import SECRET_ENV

__all__ = ["LOOPBACK", "loopback_interface", "loopback_store", "rank_env"]

LOOPBACK = "127.0.0.1"
_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def loopback_interface() -> str:
    """The name of the network interface that holds 127.0.0.1 (``lo`` on Linux)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            for _, name in socket.if_nameindex():
                try:
                    req = struct.pack("256s", name.encode()[:15])
                    addr = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, req)[20:24]
                except OSError:  # no IPv4 address
                    continue
                if socket.inet_ntoa(addr) == LOOPBACK:
                    return name
    except OSError:
        pass
    return "lo"


def loopback_store(world_size: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """A c10d store server listening on 127.0.0.1 only (a port of its own), for a world of
    ``world_size`` ranks that connect to it as clients (``TORCHELASTIC_USE_AGENT_STORE``)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((LOOPBACK, 0))
        sock.listen(max(128, 2 * world_size))
        port = sock.getsockname()[1]
        store = dist.TCPStore(LOOPBACK, port, world_size, is_master=True, timeout=timeout,
                              wait_for_workers=False, master_listen_fd=sock.detach())
    finally:
        sock.close()  # (detached: the store owns the listening socket now)
    return store


def rank_env(rank: int, world_size: int, port: int, secret: str | None = None
             ) -> dict[str, str]:
    """torchrun's variables for ``rank`` of a one-host world whose launcher hosts the store on
    loopback ``port``; with ``secret``, also the world's secret and gloo's loopback interface
    (what a launcher of `loopback_store` gives)."""
    env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
           "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": LOOPBACK,
           "MASTER_PORT": str(port)}
    if secret is not None:
        env.update({SECRET_ENV: secret, "GLOO_SOCKET_IFNAME": loopback_interface(),
                    "TORCHELASTIC_USE_AGENT_STORE": "True"})  # the launcher hosts the store
    return env
