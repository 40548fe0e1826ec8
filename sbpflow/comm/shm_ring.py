"""A ring of shared memory from one rank process to another on the same host: the bytes of the
tensors of a message, whose frame (small, over the authenticated socket) says where they are.

The sender makes the ring (`Ring.create`): an anonymous ``memfd``, which has no name in
/dev/shm, so no exit path leaves anything behind (an exception, a timeout, a killed process:
the kernel frees the memory when the last process that maps it ends). It offers the ring on
its connection; the receiver maps it through ``/proc/<pid>/fd/<fd>`` (`Ring.open`: a regular
file of the offered size, of this user, with the ring's magic), else declines, and the bytes
go inline. One producer, one consumer: `Ring.place` copies a message's buffers back to back at
the head (None when they do not fit: inline then); `Ring.read` gives views of the record a
frame names (bounds checked, `WireError` otherwise), `Ring.free` gives it back. The first page
holds 8-byte words: magic, capacity, the consumer's tail.
"""

from __future__ import annotations

import mmap
import os
import stat

from ..errors import WireError

__all__ = ["Ring", "ring_bytes", "RING_MIN"]

_MAGIC = 0x676E697277667073  # b"spfwring", little-endian
_HEADER = 4096
_TAIL = 2  # word index of the consumer's tail
RING_MIN = 1 << 14  # a message whose tensors have fewer bytes goes inline (a copy is cheaper)


def ring_bytes() -> int:
    """A ring's capacity: ``SBPFLOW_SHM_RING_MB`` MiB (default 32; 0 turns rings off)."""
    return int(float(os.environ.get("SBPFLOW_SHM_RING_MB", "32")) * (1 << 20))


class Ring:
    """One end of a ring (``mine``: the sender's, which made it). ``pid`` / ``fd`` name it for
    the other end; ``capacity`` its data bytes."""

    def __init__(self, mm: mmap.mmap, capacity: int, fd: int | None, mine: bool) -> None:
        self.mm, self.capacity, self.fd, self.mine = mm, capacity, fd, mine
        self.pid = os.getpid()
        self.words = memoryview(mm)[:_HEADER].cast("Q")
        self.data = memoryview(mm)[_HEADER:]
        self.head = 0  # sender: where the next record goes (a position: never wraps)
        self.tail = 0  # receiver: the end of the last record freed
        self._end = 0  # receiver: the end of the record read and not yet freed

    @classmethod
    def create(cls, capacity: int, name: str = "sbpflow-ring") -> "Ring":
        fd = os.memfd_create(name, os.MFD_CLOEXEC)  # (the name shows in /proc/<pid>/maps)
        try:
            os.ftruncate(fd, _HEADER + capacity)
            mm = mmap.mmap(fd, _HEADER + capacity)
        except BaseException:
            os.close(fd)
            raise
        ring = cls(mm, capacity, fd, True)
        ring.words[1], ring.words[_TAIL], ring.words[0] = capacity, 0, _MAGIC
        return ring

    @classmethod
    def open(cls, pid: int, fd: int, capacity: int) -> "Ring":
        """The receiving end of the ring rank process ``pid`` offered; `WireError` when it is
        not one (another host, another user, a wrong size)."""
        if not (type(pid) is int and type(fd) is int and type(capacity) is int
                and pid > 0 and fd >= 0 and 0 < capacity <= 1 << 40):
            raise WireError("a ring offer of the wrong form")
        try:
            mine = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise WireError(f"the offered ring cannot be opened: {exc}") from None
        try:
            st = os.fstat(mine)
            if not stat.S_ISREG(st.st_mode) or st.st_size != _HEADER + capacity \
                    or st.st_uid != os.getuid():
                raise WireError("the offered ring is not a ring of this user")
            mm = mmap.mmap(mine, _HEADER + capacity)
        finally:
            os.close(mine)  # the mapping keeps the memory
        ring = cls(mm, capacity, None, False)
        if ring.words[0] != _MAGIC or ring.words[1] != capacity:
            ring.close()
            raise WireError("the offered ring is not a ring")
        return ring

    # -- the sender's end ---------------------------------------------------------------------
    def place(self, views: list) -> int | None:
        """Copy ``views`` (byte buffers) back to back into the ring; the record's position, or
        None when they do not fit in the free space (the receiver has not freed enough)."""
        total = sum(v.nbytes for v in views)
        pos, cap = self.head, self.capacity
        if cap - pos % cap < total:  # no record wraps: skip to the start
            pos += cap - pos % cap
        if total > cap or pos + total - self.words[_TAIL] > cap:
            return None
        at = pos % cap
        for v in views:
            self.data[at:at + v.nbytes] = v
            at += v.nbytes
        self.head = pos + total
        return pos

    # -- the receiver's end -------------------------------------------------------------------
    def read(self, pos: int, sizes: list[int]) -> list[memoryview]:
        """Views of the buffers of the record at ``pos`` (`WireError` if it cannot be one)."""
        total, cap = sum(sizes), self.capacity
        if pos < self.tail or pos + total - self.tail > cap or pos % cap + total > cap:
            raise WireError(f"a frame naming ring bytes {pos}..{pos + total}, outside the "
                            f"ring's unread part (from {self.tail}, {cap} bytes)")
        at, out = pos % cap, []
        for n in sizes:
            out.append(self.data[at:at + n])
            at += n
        self._end = pos + total
        return out

    def free(self) -> None:
        """Give the last record read back to the sender."""
        self.tail = self._end
        self.words[_TAIL] = self._end

    def close(self) -> None:
        """Unmap (and, the sender's, close the memfd): the memory goes with the last mapping."""
        self.words.release()
        self.data.release()
        try:
            self.mm.close()
        except BufferError:  # a view still out (a frame being decoded): the gc unmaps it
            pass
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
