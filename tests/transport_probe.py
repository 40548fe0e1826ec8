"""What a stranger who can connect to a rank's sockets sends, and which sockets a process holds:
the probes of the transport-security tests (docs/runtime.md 'What the transport trusts')."""

from __future__ import annotations

import os
import pickle
import socket
import struct
import time


class Planted:
    """Unpickling this runs ``open(path, "w")``: the file appears if a receiver unpickles."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def payloads(path: str) -> list[bytes]:
    """What a stranger sends: a length-prefixed pickle that plants ``path`` (the old frame
    format), and garbage."""
    evil = pickle.dumps(("x", "c", Planted(path)))
    return [struct.pack("!Q", len(evil)) + evil, os.urandom(200), b"\x00" * 64 + evil]


def send_as_stranger(host: str, port: int, data: bytes) -> None:
    """Connect, read nothing, send ``data``, wait a moment for the receiver, close."""
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(data)
        time.sleep(0.05)


def tcp_sockets(pid: int) -> list[tuple[str, str, str]]:
    """``(table, local address, state)`` of every TCP socket process ``pid`` holds, from
    /proc/<pid>/net/tcp and tcp6 (addresses in the kernel's hex)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for table in ("tcp", "tcp6"):
        for line in open(f"/proc/{pid}/net/{table}").read().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes:
                out.append((table, fields[1], fields[3]))
    return out


def is_loopback(table: str, hex_address: str) -> bool:
    """A /proc/net local address in 127.0.0.0/8 (tcp), or ::1 / ::ffff:127.x (tcp6)."""
    host = hex_address.split(":")[0]
    if table == "tcp":
        return host[-2:] == "7F"  # little-endian: the first octet is last
    return host == "00000000000000000000000001000000" or \
        (host[:24] == "0000000000000000FFFF0000" and host[-2:] == "7F")
