"""Datasets and rank functions of tests/data/test_loader.py that gloo rank processes import by
name (kept free of pytest, so a rank starts fast)."""

from __future__ import annotations

import multiprocessing
import re
import threading

import torch

import sbpflow as sf

WIDTH = 5


class Encoded(torch.utils.data.Dataset):
    """Sample ``i`` is ``i * 100 + arange(WIDTH)`` (float64; its own index can be read back
    from any of its values), with the label ``i`` when ``tuples``. Reads are recorded as
    (rank, index), the rank taken from the reading thread's name (rank or loading thread) or,
    in a loading process, from the process's name; with ``log`` (a file path) also appended
    to that file, which worker processes' reads reach (`logged_reads`)."""

    def __init__(self, n: int, tuples: bool = True, fail_at: int | None = None,
                 log: str | None = None) -> None:
        self.n, self.tuples, self.fail_at, self.log = n, tuples, fail_at, log
        self.reads: list[tuple[int, int]] = []
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if i == self.fail_at:
            raise ValueError(f"sample {i} is broken")
        name = threading.current_thread().name
        if name == "MainThread":  # a worker process: sbpflow-data-rank<r>-worker<k>
            name = multiprocessing.current_process().name
        m = re.search(r"rank(\d+)(-worker\d+)?$", name)
        rank = int(m.group(1)) if m else -1
        with self._lock:
            self.reads.append((rank, i))
        if self.log:  # one short O_APPEND write a read: lines of processes do not mix
            with open(self.log, "a") as f:
                f.write(f"{rank} {i}\n")
        x = i * 100 + torch.arange(WIDTH, dtype=torch.float64)
        return (x, i) if self.tuples else x

    def logged_reads(self) -> list[tuple[int, int]]:
        """The (rank, index) reads appended to ``log``, by every thread and process."""
        with open(self.log) as f:
            return [tuple(map(int, line.split())) for line in f]

    def __getstate__(self):
        return {"n": self.n, "tuples": self.tuples, "fail_at": self.fail_at, "log": self.log}

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
