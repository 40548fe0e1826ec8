"""Ways to damage one file of a checkpoint, each a function of the file's path: the one catalogue
that tests/nn/test_checkpoint_faults.py and the probe benchmarks/checkpoint_faults.py both use."""

from __future__ import annotations

import os


def flip(at: float):
    """Invert the byte at fraction ``at`` of the file (0: the first, 1: the last)."""
    def damage(p: str) -> None:
        with open(p, "r+b") as f:
            n = f.seek(0, 2)
            f.seek(min(int(n * at), n - 1))
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0xFF]))
    return damage


def truncate_half(p: str) -> None:
    os.truncate(p, os.path.getsize(p) // 2)


def drop_last_byte(p: str) -> None:
    os.truncate(p, os.path.getsize(p) - 1)


def append_garbage(p: str) -> None:
    with open(p, "ab") as f:
        f.write(b"\x00garbage\n")


def overwrite(data: bytes):
    """Replace the file's content with ``data``."""
    def damage(p: str) -> None:
        with open(p, "wb") as f:
            f.write(data)
    return damage


FILE_DAMAGE = {"flip-first-byte": flip(0.0), "flip-middle-byte": flip(0.5),
               "flip-last-byte": flip(1.0), "truncate-half": truncate_half,
               "drop-last-byte": drop_last_byte, "append-garbage": append_garbage,
               "delete": os.remove}
