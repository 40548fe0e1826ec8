"""``DataLoader(workers=k)``: batches through the worker processes' shared-memory slots equal
torch's one-device batches in order over epochs (several slots a worker, budgets above and
below ``k``, batches that grow past a slot's size, a smaller last batch, abandoned epochs); a
worker that dies raises `DataLoaderError` naming it; a worker holds no other pool's pipes or
slots (fork safety); closing ends the workers."""

from __future__ import annotations

import multiprocessing
import os
import re
import signal
import threading
import time
from collections import namedtuple

import pytest
import torch

import sbpflow as sf
from loader_fns import Encoded


class Growing(torch.utils.data.Dataset):
    """Sample ``i``: ``arange(width)`` + i (float32) with the label ``i``, the width growing
    with ``i // group`` (a batch of ``group`` unshuffled samples has one width), so later
    batches outgrow the slots sized for the first ones."""

    def __init__(self, n: int, group: int) -> None:
        self.n, self.group = n, group

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        width = 1 + (i // self.group) * 3000
        return torch.arange(width, dtype=torch.float32) + i, i


def _torch(ds, bs: int, drop_last: bool = False) -> list:
    return list(torch.utils.data.DataLoader(ds, batch_size=bs, drop_last=drop_last))


@pytest.mark.parametrize("workers,prefetch", [(1, 1), (2, 5), (3, 2)])
def test_growing_batches_through_the_slots_equal_torch(workers, prefetch):
    ds = Growing(23, 4)  # 6 batches: widths 1 .. 15001 floats, the last of 3 samples

    def fn():
        loader = sf.data.DataLoader(ds, 4, sf.placement("cpu", [0]), shuffle=False,
                                    drop_last=False, prefetch=prefetch, workers=workers)
        try:
            return [[(x.full_tensor(), y.full_tensor()) for x, y in loader] for _ in range(2)]
        finally:
            loader.close()

    want = _torch(ds, 4)
    for epoch in sf.launch(fn, 1)[0]:
        assert len(epoch) == len(want) == 6
        for (x, y), (wx, wy) in zip(epoch, want):
            assert torch.equal(x, wx) and torch.equal(y, wy)


def test_shuffled_epochs_with_abandoned_ones_on_two_ranks():
    """Two ranks, S(0), three workers a rank, budget 4: each epoch equals torch's, an epoch
    abandoned after two batches does not leak into the next."""
    ds = Encoded(30)
    pl = sf.placement("cpu", [0, 1])

    def fn():
        loader = sf.data.DataLoader(ds, 6, pl, seed=3, prefetch=4, workers=3)
        out = []
        for epoch in range(3):
            loader.set_epoch(epoch)
            it = iter(loader)
            next(it), next(it)
            del it
            out.append([(x.full_tensor(), y.full_tensor()) for x, y in loader])
        loader.close()
        return out

    for out in sf.launch(fn, 2):
        for epoch, got in enumerate(out):
            sampler = torch.utils.data.DistributedSampler(Encoded(30), 1, 0, seed=3)
            sampler.set_epoch(epoch)
            want = list(torch.utils.data.DataLoader(Encoded(30), batch_size=6, sampler=sampler))
            assert len(got) == len(want) == 5
            for (x, y), (wx, wy) in zip(got, want):
                assert torch.equal(x, wx) and torch.equal(y, wy)


def test_a_worker_that_dies_raises_naming_it():
    def fn():
        loader = sf.data.DataLoader(Encoded(40), 4, sf.placement("cpu", [0]), prefetch=1,
                                    workers=2)
        it = iter(loader)
        next(it)
        proc = loader._pools[0].procs[1]
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        try:
            for _ in it:
                pass
        finally:
            loader.close()

    # worker 1 may have finished batch 1 before the kill: the loader then learns of its end
    # at batch 1's read or at batch 3's grant (each names it)
    with pytest.raises(sf.errors.DataLoaderError, match=r"worker process sbpflow-data-rank0-worker1 "
                                                 r"\(pid \d+\) was killed by signal 9 "
                                                 r"\(SIGKILL\) (without batch 1|before it "
                                                 r"was given batch \d+)"):
        sf.launch(fn, 1)


class _Slow(torch.utils.data.Dataset):
    """Sample ``i``: ``[i]``, read in 0.3 s (a consumer waits for its worker meanwhile)."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        time.sleep(0.3)
        return torch.tensor([float(i)])


def test_a_worker_killed_while_the_consumer_waits_names_the_signal():
    """A worker killed while the consumer waits for its batch: the consumer sees the pipe
    close before the kernel can reap the worker, and the error still names the signal (it
    said ``exit code None`` when it read the exit code at once). Repeated to meet the race."""

    def fn():
        messages = []
        for _ in range(4):
            loader = sf.data.DataLoader(_Slow(), 2, sf.placement("cpu", [0]), shuffle=False,
                                        prefetch=1, workers=1)
            it = iter(loader)
            proc = loader._pools[0].procs[0]
            threading.Timer(0.1, os.kill, (proc.pid, signal.SIGKILL)).start()
            with pytest.raises(sf.errors.DataLoaderError) as info:
                next(it)
            loader.close()
            messages.append(re.sub(r"pid \d+", "pid N", str(info.value)))
        return messages

    want = ("DataLoader: worker process sbpflow-data-rank0-worker0 (pid N) was killed by "
            "signal 9 (SIGKILL) without batch 0")
    assert sf.launch(fn, 1)[0] == [want] * 4


def _inodes(pid: int) -> set:
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            st = os.stat(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        out.add((st.st_dev, st.st_ino))
    return out


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_a_worker_holds_no_other_pools_pipes_or_slots():
    """A worker forked after another pool holds none of that pool's pipe ends or slot files
    (held, they would keep the other pool's worker from seeing its end, and its slots'
    memory alive); closing a loader ends its workers while the other's keep serving."""
    def fn():
        pl = sf.placement("cpu", [0])
        first = sf.data.DataLoader(Encoded(12), 4, pl, workers=1)
        second = sf.data.DataLoader(Encoded(12), 4, pl, workers=1)
        assert len(list(first)) == len(list(second)) == 3
        pool1, pool2 = first._pools[0], second._pools[0]
        ours1 = {(s.st_dev, s.st_ino) for s in map(os.fstat, pool1.grants + pool1.replies
                                                    + pool1.slots[0])}
        held = _inodes(pool2.procs[0].pid) & ours1
        proc1 = pool1.procs[0]
        first.close()
        proc1.join(10)
        return held, proc1.is_alive(), len(list(second))

    held, alive, batches = sf.launch(fn, 1)[0]
    assert held == set() and not alive and batches == 3


Item = namedtuple("Item", "x label")  # module level: a worker process's batches carry the class


class Structured(torch.utils.data.Dataset):
    """Sample ``i`` as a namedtuple, a dict or a list (``kind``)."""

    def __init__(self, n: int, kind: str) -> None:
        self.n, self.kind = n, kind

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        x = torch.arange(4, dtype=torch.float64) * i
        if self.kind == "namedtuple":
            return Item(x, i)
        return {"x": x, "label": i} if self.kind == "dict" else [x, i]


@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.parametrize("kind", ["namedtuple", "dict", "list"])
def test_items_keep_their_structure_as_torch_does(kind, workers):
    """Batches take the items' structure (a namedtuple, a dict, a list) with global tensors
    whose values are torch's ``default_collate``'s, on two ranks with S(0)."""
    ds = Structured(8, kind)

    def fn():
        loader = sf.data.DataLoader(ds, 4, sf.placement("cpu", [0, 1]), shuffle=False,
                                    workers=workers)
        try:
            out = []
            for b in loader:
                pairs = b.items() if kind == "dict" else enumerate(b)
                out.append((type(b), {k: (v.sbp, v.full_tensor()) for k, v in pairs},
                            b.label.full_tensor() if kind == "namedtuple" else None))
            return out
        finally:
            loader.close()

    want = _torch(ds, 4)
    got = sf.launch(fn, 2)[0]
    assert len(got) == len(want) == 2
    for (kind_got, values, label), ref in zip(got, want):
        assert kind_got is type(ref)  # Item, dict, list: default_collate keeps them too
        assert len(values) == 2
        for k, (sbp, value) in values.items():
            assert sbp == (sf.S(0),) and torch.equal(value, ref[k]), (kind, k)
        if kind == "namedtuple":
            assert torch.equal(label, ref.label)


def test_the_default_is_a_loading_process_where_the_platform_forks(monkeypatch):
    """``workers=None`` (the default): one process a rank, but the loading thread with
    ``prefetch=0`` (each batch on demand, in the caller), where the platform cannot fork or
    once CUDA is initialised (a forked child cannot use it); a given count is kept. The
    default loader's batches equal torch's and its processes end with ``close``."""
    pl = sf.placement("cpu", [0])
    ds = Encoded(12)
    assert sf.data.DataLoader(ds, 4, pl).workers == 1
    assert sf.data.DataLoader(ds, 4, pl, prefetch=0).workers == 0
    assert [sf.data.DataLoader(ds, 4, pl, workers=k).workers for k in (0, 2)] == [0, 2]
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_initialized", lambda: True)
        assert sf.data.DataLoader(ds, 4, pl).workers == 0
    with monkeypatch.context() as m:
        m.setattr(multiprocessing, "get_all_start_methods", lambda: ["spawn"])
        assert sf.data.DataLoader(ds, 4, pl).workers == 0

    def fn():
        loader = sf.data.DataLoader(ds, 4, pl, shuffle=False)
        got = [(x.full_tensor(), y.full_tensor()) for x, y in loader]
        procs = list(loader._pools[0].procs)
        loader.close()
        return got, procs

    got, procs = sf.launch(fn, 1)[0]
    want = _torch(Encoded(12), 4)
    assert len(got) == len(want) == 3 and len(procs) == 1
    assert all(torch.equal(x, wx) and torch.equal(y, wy) for (x, y), (wx, wy) in zip(got, want))
    for p in procs:
        p.join(10)
    assert not any(p.is_alive() for p in procs)


class _Unpicklable(Exception):
    """An exception whose class takes two arguments: it pickles but does not unpickle."""

    def __init__(self, a, b) -> None:
        super().__init__(f"{a} and {b}")


class _Failing(torch.utils.data.Dataset):
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int):
        raise self.exc


@pytest.mark.parametrize("exc,cause", [(KeyError("k"), KeyError), (_Unpicklable(1, 2), None)])
def test_a_worker_error_keeps_its_cause_when_it_can(exc, cause):
    """A failing ``__getitem__`` in a worker: `DataLoaderError` naming the worker and the
    sample, with the dataset's exception as its cause (as with the loading thread), or none
    when that exception does not come back through pickle (its message still named)."""
    def fn():
        loader = sf.data.DataLoader(_Failing(exc), 2, sf.placement("cpu", [0]), shuffle=False,
                                    workers=1)
        try:
            next(iter(loader))
        finally:
            loader.close()

    with pytest.raises(sf.errors.DataLoaderError, match=r"worker process sbpflow-data-rank0-worker0:"
                                                 r".*reading sample 0 .*" + type(exc).__name__
                       ) as info:
        sf.launch(fn, 1)
    if cause is None:
        assert info.value.__cause__ is None
    else:
        assert isinstance(info.value.__cause__, cause) and info.value.__cause__.args == ("k",)


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling policies")
def test_workers_are_batch_tasks():
    """A worker is SCHED_BATCH: woken by a grant, it never preempts the rank that granted."""
    def fn():
        loader = sf.data.DataLoader(Encoded(8), 4, sf.placement("cpu", [0]), workers=1)
        try:
            next(iter(loader))
            return os.sched_getscheduler(loader._pools[0].procs[0].pid)
        finally:
            loader.close()

    assert sf.launch(fn, 1)[0] == os.SCHED_BATCH


class _Dtypes(torch.utils.data.Dataset):
    """Sample ``i``: tensors of several dtypes and odd byte sizes (bfloat16 has no numpy
    twin; a 3-byte bool row leaves the next shard to be padded to its alignment)."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int):
        return (torch.arange(3) % 2 == i % 2, torch.full((5,), i / 3, dtype=torch.bfloat16),
                torch.full((2,), i, dtype=torch.int8), torch.full((3,), i / 7,
                                                                  dtype=torch.float16),
                torch.full((2,), complex(i, -i), dtype=torch.complex64), float(i))


def test_batches_of_many_dtypes_through_the_slots_equal_torch():
    def fn():
        loader = sf.data.DataLoader(_Dtypes(), 3, sf.placement("cpu", [0]), shuffle=False,
                                    workers=1)
        try:
            return [[t.full_tensor() for t in batch] for batch in loader]
        finally:
            loader.close()

    want = _torch(_Dtypes(), 3)
    got = sf.launch(fn, 1)[0]
    assert len(got) == len(want) == 2
    for batch, ref in zip(got, want):
        assert [t.dtype for t in batch] == [t.dtype for t in ref]
        assert all(torch.equal(a, b) for a, b in zip(batch, ref))


@pytest.mark.parametrize("workers", [0, 1])
def test_a_called_loader_starts_the_next_epoch_at_the_last_batch(workers):
    """``loader()`` at an epoch's last batch starts the next epoch's feed (its loading runs
    during that step) without counting the epoch up before the next call; an iteration of the
    same loader that abandons that feed's workers meanwhile does not leave the next call
    waiting: it gets the next epoch's first batch, as torch's sampler orders it."""
    ds = Encoded(12)

    def fn():
        loader = sf.data.DataLoader(ds, 4, sf.placement("cpu", [0]), seed=3, workers=workers)
        try:
            first = [loader()[1].full_tensor() for _ in range(len(loader))]
            ahead = (loader.epoch, loader._feeds[0].epoch)
            evaluated = [y.full_tensor() for _, y in loader]   # epoch 0 again, iterated
            second = [loader()[1].full_tensor() for _ in range(len(loader))]
            return first, ahead, evaluated, second, loader.epoch
        finally:
            loader.close()

    first, ahead, evaluated, second, epoch = sf.launch(fn, 1)[0]
    assert ahead == (0, 1) and epoch == 1

    def want(e):
        sampler = torch.utils.data.DistributedSampler(Encoded(12), 1, 0, seed=3)
        sampler.set_epoch(e)
        return [y for _, y in torch.utils.data.DataLoader(Encoded(12), 4, sampler=sampler)]

    for got, e in ((first, 0), (evaluated, 0), (second, 1)):
        assert len(got) == 3 and all(torch.equal(a, b) for a, b in zip(got, want(e)))


def _new_children(before: set) -> list[str]:
    """The names of this process's live children not in ``before`` (pids)."""
    return sorted(p.name for p in multiprocessing.active_children() if p.pid not in before)


def test_failed_launches_leave_no_worker_processes():
    """Each rank's loader closes its workers when the rank's function raises, with the
    garbage collector off and the caller keeping every exception (whose traceback holds the
    rank's frame, and so the loader): no process is left after any launch (4, 8, 12, 16 of
    them before, until a gc.collect())."""
    import gc

    def fn():
        loader = sf.data.DataLoader(Encoded(64, fail_at=2), 8, sf.placement("cpu", range(4)),
                                    workers=1)
        for _ in loader:
            pass

    before = {p.pid for p in multiprocessing.active_children()}
    kept, counts = [], []
    enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(4):
            with pytest.raises(sf.errors.DataLoaderError, match="sample 2 is broken") as info:
                sf.launch(fn, 4)
            kept.append(info)
            counts.append(_new_children(before))
    finally:
        if enabled:
            gc.enable()
    assert counts == [[]] * 4


def test_a_rank_that_returns_closes_its_called_loaders_workers():
    """A called loader (``loader()``) is in a reference cycle with its feed; its workers still
    end when the rank's function returns, not at the next garbage collection."""
    import gc

    def fn():
        loader = sf.data.DataLoader(Encoded(16), 4, sf.placement("cpu", [0, 1]), workers=2)
        return len(loader()), len(loader._pools[sf.rank()].procs)

    before = {p.pid for p in multiprocessing.active_children()}
    enabled = gc.isenabled()
    gc.disable()
    try:
        assert sf.launch(fn, 2) == [(2, 2), (2, 2)]
        left = _new_children(before)
    finally:
        if enabled:
            gc.enable()
    assert left == []
