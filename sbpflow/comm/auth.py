"""The world's secret and the proofs that a peer holds it (HMAC-SHA256 challenge and response,
both ways, as ``multiprocessing.connection``'s authkey handshake).

A connection to a rank's message socket is read for frames only after the peer proved it holds
the world's secret; the connecting side checks the listener's proof in turn, so neither side
talks to a stranger. Messages through the store fallback carry an HMAC tag of the same secret.
The secret (`world_secret`): ``SBPFLOW_SECRET`` when set (``sf.launch`` and ``sbpflow run``
set a random one for their processes), else made by rank 0 and shared through the c10d store
at rendezvous, which anyone who can reach the store can read: docs/runtime.md, 'What the
transport trusts'.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import os
import secrets
import socket

import torch.distributed as dist

from ..errors import WireError

__all__ = ["SECRET_ENV", "NONCE", "new_secret", "world_secret", "ServerHandshake",
           "client_handshake", "seal", "unseal"]

SECRET_ENV = "SBPFLOW_SECRET"
NONCE = 32  # bytes of a challenge; an HMAC-SHA256 proof is 32 too
_MAGIC = b"sbpflow/1"  # the listener's first bytes: the protocol and its version
_KEY = "sbpflow/world-secret"
_CLIENT, _SERVER = b"client", b"server"  # a proof says which side made it (no reflection)


def new_secret() -> str:
    """A fresh random secret (256 bits, hex): what a launcher gives its processes."""
    return secrets.token_hex(32)


def world_secret(store: dist.Store, rank: int, timeout: float) -> bytes:
    """This world's secret: ``SBPFLOW_SECRET``, else rank 0's random one read from ``store``
    (waited for up to ``timeout`` s)."""
    env = os.environ.get(SECRET_ENV)
    if env:
        return env.encode()
    if rank == 0 and not store.check([_KEY]):  # (a second communicator keeps the first's)
        store.set(_KEY, new_secret())
    try:
        store.wait([_KEY], datetime.timedelta(seconds=timeout))
        return store.get(_KEY)
    except (RuntimeError, OSError) as exc:
        raise WireError(f"rank {rank}: the world's secret was not in the store within "
                        f"{timeout:g} s (set {SECRET_ENV} to the same value on every rank, or "
                        f"start rank 0): {exc}") from exc


def _proof(secret: bytes, side: bytes, *nonces: bytes) -> bytes:
    return hmac.new(secret, side + b"".join(nonces), hashlib.sha256).digest()


class ServerHandshake:
    """The listening side of one connection, fed as its bytes arrive (a non-blocking socket):
    send ``hello``; ``feed(data)`` returns None until the peer's nonce and proof are in, then
    ``(reply, rest)``: the proof to send back and the bytes after the handshake. A wrong proof
    raises `WireError`."""

    def __init__(self, secret: bytes) -> None:
        self.secret = secret
        self.nonce = secrets.token_bytes(NONCE)
        self.hello = _MAGIC + self.nonce
        self._got = bytearray()

    def feed(self, data: bytes) -> tuple[bytes, bytes] | None:
        self._got += data
        if len(self._got) < 2 * NONCE:
            return None
        theirs, proof = bytes(self._got[:NONCE]), bytes(self._got[NONCE:2 * NONCE])
        if not hmac.compare_digest(proof, _proof(self.secret, _CLIENT, self.nonce, theirs)):
            raise WireError("the peer did not prove it holds the world's secret")
        return _proof(self.secret, _SERVER, theirs, self.nonce), bytes(self._got[2 * NONCE:])


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        part = sock.recv(n - len(out))
        if not part:
            raise WireError(f"the connection closed after {len(out)} of {n} handshake bytes")
        out += part
    return bytes(out)


def client_handshake(sock: socket.socket, secret: bytes) -> None:
    """The connecting side (a blocking socket with a timeout): answer the listener's challenge
    and check its proof; `WireError` if it is not a rank of this world."""
    hello = _recv_exact(sock, len(_MAGIC) + NONCE)
    if not hello.startswith(_MAGIC):
        raise WireError("the listener does not speak sbpflow's channel protocol")
    server_nonce, mine = hello[len(_MAGIC):], secrets.token_bytes(NONCE)
    sock.sendall(mine + _proof(secret, _CLIENT, server_nonce, mine))
    if not hmac.compare_digest(_recv_exact(sock, NONCE),
                               _proof(secret, _SERVER, mine, server_nonce)):
        raise WireError("the listener did not prove it holds the world's secret")


def seal(secret: bytes, data: bytes) -> bytes:
    """``data`` with an HMAC tag in front (a message through the store)."""
    return hmac.new(secret, data, hashlib.sha256).digest() + data


def unseal(secret: bytes, sealed: bytes) -> bytes:
    """The data of a `seal`-ed message; `WireError` if its tag is not the secret's."""
    tag, data = sealed[:NONCE], sealed[NONCE:]
    if len(tag) < NONCE or not hmac.compare_digest(
            tag, hmac.new(secret, data, hashlib.sha256).digest()):
        raise WireError("a store message whose tag is not the world's secret's")
    return data
