"""All-gather and all-reduce through shared memory, for a group of rank processes on one host.

Each member writes its bytes into its own segment (an anonymous memfd, `shm_ring.Ring`: mapped
by the others through ``/proc/<pid>/fd``, checked for owner, size and magic; nothing named in
/dev/shm) and reads the others' straight from theirs; gloo carries only a barrier. An
all-gather is a copy in, a barrier, the pieces copied out in group order. An all-reduce is a
copy in, a barrier, each member reducing its own chunk of the elements over every member's
input in group order (`base.reduce_tensors`' order: bit-equal to the threads backend's whole
reduction), a barrier, the chunks copied out. Calls alternate between the two halves of each
segment, so a member that is one call ahead never overwrites bytes a slower one still reads.
``SBPFLOW_SHM_COLLECTIVE_MB`` sets a segment's size (default 64; 0 turns the path off).
See docs/internals.md, 'The torch.distributed backend'.
"""

from __future__ import annotations

import os
import socket
import zlib
from typing import Callable, Sequence

import torch

from ..errors import WireError
from .base import reduce_tensors
from .shm_ring import Ring

__all__ = ["ShmGroup", "segment_bytes", "SHM_MIN", "host_id"]

SHM_MIN = 1 << 16  # fewer bytes: gloo's one round trip is cheaper than a barrier and copies
_ALIGN = 64


def segment_bytes() -> int:
    """A member's segment: ``SBPFLOW_SHM_COLLECTIVE_MB`` MiB (default 64; 0: no shared-memory
    collectives)."""
    return int(float(os.environ.get("SBPFLOW_SHM_COLLECTIVE_MB", "64")) * (1 << 20))


def host_id() -> int:
    """This host, as a number the members compare (host name and boot id: one kernel)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            boot = f.read()
    except OSError:
        boot = b""
    return zlib.crc32(socket.gethostname().encode() + boot) & 0x7FFFFFFF


def _up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class ShmGroup:
    """The segments of one group's members, this member's own first made (`create`), the others
    mapped once they are offered (`join`). ``barrier()`` is the group's gloo barrier (its
    failures and timeouts are the backend's). ``members``: the group in pg-rank order."""

    def __init__(self, capacity: int) -> None:
        self.own = Ring.create(capacity, "sbpflow-collectives")
        self.half = capacity // 2 // _ALIGN * _ALIGN
        self.rings: dict[int, Ring] = {}
        self.bufs: dict[int, torch.Tensor] = {}   # member -> its segment's data, as bytes
        self.me = -1
        self.calls = 0

    def offer(self) -> list[int]:
        """What the others need to map this member's segment: pid, fd, size, host."""
        return [self.own.pid, self.own.fd, self.own.capacity, host_id()]

    def join(self, me: int, offers: Sequence[Sequence[int]]) -> bool:
        """Map every other member's segment (``offers[k]``: member k's `offer`); False when one
        is on another host or cannot be mapped (then none is kept)."""
        try:
            for k, (pid, fd, capacity, host) in enumerate(offers):
                if k == me:
                    ring = self.own
                elif host != host_id():
                    raise WireError("a member on another host")
                else:
                    ring = Ring.open(int(pid), int(fd), int(capacity))
                self.rings[k] = ring
                self.bufs[k] = torch.frombuffer(ring.data, dtype=torch.uint8)
        except (WireError, OSError):  # (OSError: a mapping refused, e.g. out of memory)
            self.close(keep_own=True)
            return False
        self.me = me
        return True

    def fits(self, nbytes: int, n: int) -> bool:
        """Whether an all-reduce (input and one chunk) or an all-gather piece fits a half."""
        return _up(nbytes) + _up(-(-nbytes // n)) <= self.half

    def _area(self) -> int:
        at = (self.calls % 2) * self.half
        self.calls += 1
        return at

    def all_gather(self, b: torch.Tensor, order: Sequence[int], barrier: Callable[[], None],
                   out: torch.Tensor) -> None:
        """``out`` (``len(order) * b.numel()`` bytes) := every member's ``b`` (flat uint8), in
        the order of the pg ranks ``order``."""
        at, n = self._area(), b.numel()
        self.bufs[self.me][at:at + n].copy_(b)
        barrier()
        for j, k in enumerate(order):
            out[j * n:(j + 1) * n].copy_(self.bufs[k][at:at + n])

    def all_reduce(self, t: torch.Tensor, order: Sequence[int], op: str,
                   barrier: Callable[[], None]) -> torch.Tensor:
        """A new tensor: ``t`` reduced over the members with ``op``, in the order of the pg
        ranks ``order`` (member ``order[j]`` reduces chunk j of the elements)."""
        at, numel, size = self._area(), t.numel(), t.element_size()
        nb = numel * size
        mine = self.me
        self.bufs[mine][at:at + nb].view(t.dtype).copy_(t.reshape(-1))
        barrier()
        chunk = -(-numel // len(order))
        j = order.index(mine)
        lo, hi = min(j * chunk, numel), min((j + 1) * chunk, numel)
        res = at + _up(nb)
        if hi > lo:
            got = reduce_tensors([self.bufs[k][at:at + nb].view(t.dtype)[lo:hi] for k in order],
                                 op)
            self.bufs[mine][res:res + (hi - lo) * size].view(t.dtype).copy_(got)
        barrier()
        out = torch.empty(numel, dtype=t.dtype)
        for j, k in enumerate(order):
            lo, hi = min(j * chunk, numel), min((j + 1) * chunk, numel)
            if hi > lo:
                out[lo:hi].copy_(self.bufs[k][res:res + (hi - lo) * size].view(t.dtype))
        return out.view(t.shape)

    def close(self, keep_own: bool = False) -> None:
        """Unmap the others' segments (and this member's own unless ``keep_own``)."""
        self.bufs.clear()
        for ring in self.rings.values():
            if ring is not self.own:
                ring.close()
        self.rings.clear()
        if not keep_own:
            self.own.close()
