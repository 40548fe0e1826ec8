"""Datasets and rank functions of tests/data/test_loader.py that gloo rank processes import by
name (kept free of pytest, so a rank starts fast)."""

from __future__ import annotations

import re
import threading

import torch

import sbpflow as sf

WIDTH = 5


class Encoded(torch.utils.data.Dataset):
    """Sample ``i`` is ``i * 100 + arange(WIDTH)`` (float64; its own index can be read back
    from any of its values), with the label ``i`` when ``tuples``. Reads are recorded as
    (rank, index), the rank taken from the reading thread's name (rank or loading thread)."""

    def __init__(self, n: int, tuples: bool = True, fail_at: int | None = None) -> None:
        self.n, self.tuples, self.fail_at = n, tuples, fail_at
        self.reads: list[tuple[int, int]] = []
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if i == self.fail_at:
            raise ValueError(f"sample {i} is broken")
        m = re.search(r"rank(\d+)$", threading.current_thread().name)
        with self._lock:
            self.reads.append((int(m.group(1)) if m else -1, i))
        x = i * 100 + torch.arange(WIDTH, dtype=torch.float64)
        return (x, i) if self.tuples else x

    def __getstate__(self):
        return {"n": self.n, "tuples": self.tuples, "fail_at": self.fail_at}

    def __setstate__(self, state) -> None:
        self.__init__(**state)


def full_batches(n: int, batch_size: int, world: int, seed: int, epoch: int,
                 drop_last: bool) -> list:
    """On a rank of ``world`` gloo ranks: the full values (x, label) of every batch of a
    DataLoader on a 1-D placement with S(0), and this rank's local shard shapes."""
    pl = sf.placement("cpu", list(range(world)))
    loader = sf.data.DataLoader(Encoded(n), batch_size, pl, seed=seed, drop_last=drop_last)
    loader.set_epoch(epoch)
    return [(x.full_tensor(), y.full_tensor(), tuple(x.local.shape)) for x, y in loader]
