"""Several feeds of one loader on a rank, and a loader's state that changes between epochs:
two iterators (``zip(loader, loader)``, a nested loop), calls mixed with an iteration, a
loader closed with an epoch under way, a dataset whose length changed, a loader shared by
rank threads. With worker processes (the default) each gives the batches of ``workers=0``,
which are torch's own, and a closed pool's descriptors are never touched again."""

from __future__ import annotations

import os

import pytest
import torch

import sbpflow as sf
from loader_fns import Encoded

SEED = 5


def _want(n: int, bs: int, epoch: int, seed: int = SEED, shuffle: bool = True) -> list:
    """Torch's labels of each batch of ``epoch`` (one device, drop_last)."""
    sampler = torch.utils.data.DistributedSampler(Encoded(n), 1, 0, shuffle=shuffle, seed=seed)
    sampler.set_epoch(epoch)
    return [y.tolist() for _, y in torch.utils.data.DataLoader(
        Encoded(n), batch_size=bs, sampler=sampler, drop_last=True)]


def _labels(batch) -> list:
    return batch[1].full_tensor().tolist()


@pytest.mark.parametrize("workers", [0, None])
def test_two_iterators_of_one_loader_each_give_the_epoch(workers):
    """``zip(loader, loader)`` and a full inner pass in each step of an outer one (an
    evaluation inside training): every iterator gives the whole epoch in torch's order. With
    worker processes the older iterator crashed on a None batch or waited the timeout."""
    pl = sf.placement("cpu", [0, 1])

    def fn():
        loader = sf.data.DataLoader(Encoded(12), 3, pl, seed=SEED, workers=workers,
                                    timeout=20)
        try:
            zipped = [(_labels(a), _labels(b)) for a, b in zip(loader, loader)]
            nested = [(_labels(x), [_labels(y) for y in loader]) for x in loader]
            return zipped, nested
        finally:
            loader.close()

    want = _want(12, 3, 0)
    for zipped, nested in sf.launch(fn, 2):
        assert zipped == [(w, w) for w in want]
        assert nested == [(w, want) for w in want]


@pytest.mark.parametrize("workers", [0, None])
def test_calls_around_an_iteration_go_on_in_their_epoch(workers):
    """A called loader, then a whole iteration of it, then calls again: the calls go on with
    epoch 0's next batch and into epoch 1, as torch orders them."""
    def fn():
        loader = sf.data.DataLoader(Encoded(12), 3, sf.placement("cpu", [0, 1]), seed=SEED,
                                    workers=workers, timeout=20)
        try:
            first = _labels(loader())
            iterated = [_labels(b) for b in loader]
            rest = [_labels(loader()) for _ in range(4)]
            return first, iterated, rest, loader.epoch
        finally:
            loader.close()

    e0, e1 = _want(12, 3, 0), _want(12, 3, 1)
    for first, iterated, rest, epoch in sf.launch(fn, 2):
        assert [first] + rest == e0 + e1[:1] and iterated == e0 and epoch == 1


def _user_pipes(count: int) -> list:
    """``count`` pipes of the user's, a marker written into each (they take the lowest free
    descriptor numbers: those a closed pool had)."""
    pipes = [os.pipe() for _ in range(count)]
    for k, (_, w) in enumerate(pipes):
        os.write(w, b"user data %d" % k)
    return pipes


def _untouched(pipes: list) -> bool:
    ok = True
    for k, (r, w) in enumerate(pipes):
        os.set_blocking(r, False)
        try:
            ok &= os.read(r, 100) == b"user data %d" % k
        except BlockingIOError:  # the loader read the user's data
            ok = False
        os.close(r)
        os.close(w)
    return ok


@pytest.mark.parametrize("workers", [0, None])
def test_a_loader_closed_mid_epoch_goes_on_without_its_descriptors(workers):
    """``close()`` with an epoch under way (a called feed mid-epoch, one started ahead at an
    epoch's last batch, an open iterator): the calls and the iterator go on with the right
    batches; the closed pool's descriptors, reused by the user's pipes, are neither read nor
    written; the next epoch forks new workers."""
    def fn():
        pl = sf.placement("cpu", [0])
        called = sf.data.DataLoader(Encoded(12), 3, pl, seed=SEED, workers=workers, timeout=20)
        ahead = sf.data.DataLoader(Encoded(12), 6, pl, seed=SEED, workers=workers, timeout=20)
        iterated = sf.data.DataLoader(Encoded(12), 3, pl, seed=SEED, workers=workers,
                                      timeout=20)
        out = [_labels(called()), [_labels(ahead()) for _ in range(2)]]
        it = iter(iterated)
        out.append(_labels(next(it)))
        for loader in (called, ahead, iterated):
            loader.close()
        pipes = _user_pipes(24)
        out += [[_labels(called()) for _ in range(4)], _labels(ahead()),
                [_labels(b) for b in it]]
        forked = [len(loader._pools) for loader in (called, ahead)]
        for loader in (called, ahead, iterated):
            loader.close()
        return out, _untouched(pipes), forked

    out, untouched, forked = sf.launch(fn, 1)[0]
    e0, e1 = _want(12, 3, 0), _want(12, 3, 1)
    assert out == [e0[0], _want(12, 6, 0), e0[0], e0[1:] + e1[:1], _want(12, 6, 1)[0], e0[1:]]
    assert untouched
    assert forked == ([1, 1] if workers is None else [0, 0])


class _Resizable(torch.utils.data.Dataset):
    """Sample ``i`` is ``[i]`` while ``i < n``; ``n`` is changed between epochs."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if not 0 <= i < self.n:
            raise IndexError(f"{i} not in a dataset of {self.n}")
        return torch.tensor([i])


@pytest.mark.parametrize("workers", [0, None])
def test_a_dataset_grown_or_shrunk_between_epochs_is_read_at_its_new_length(workers):
    """A dataset whose length changes before the next epoch (a curriculum): that epoch is
    ``randperm`` of the new length, as torch's sampler orders it. Worker processes forked at
    the old length kept it (a grown dataset failed with an IndexError, a shrunk one gave
    indices no longer in it)."""
    ds = _Resizable(8)

    def fn():
        loader = sf.data.DataLoader(ds, 4, sf.placement("cpu", [0, 1]), seed=SEED,
                                    workers=workers, timeout=20)
        out = []
        try:
            for epoch, n in enumerate((8, 12, 6)):
                ds.n = n
                loader.set_epoch(epoch)
                out.append([b.full_tensor().flatten().tolist() for b in loader])
            return out
        finally:
            loader.close()

    want = [_want(n, 4, epoch) for epoch, n in enumerate((8, 12, 6))]
    assert sf.launch(fn, 2)[0] == want


@pytest.mark.parametrize("workers", [0, None])
def test_a_loader_shared_by_rank_threads_gives_each_rank_its_batches(workers):
    """One loader made outside ``sf.launch`` and called on every rank thread: each rank goes
    through epoch 0 then 1 in torch's order (the called feed is per rank; it was one for the
    loader, which mixed the ranks' batches). Iterating it too."""
    loader = sf.data.DataLoader(Encoded(8), 4, sf.placement("cpu", [0, 1]), seed=SEED,
                                workers=workers, timeout=20)

    def fn():
        called = [_labels(loader()) for _ in range(4)]
        return called, [_labels(b) for b in loader]

    try:
        got = sf.launch(fn, 2)
    finally:
        loader.close()
    e0, e1 = _want(8, 4, 0), _want(8, 4, 1)
    assert got == [(e0 + e1, e1)] * 2


def test_a_called_loader_without_batches_raises_and_keeps_its_epoch():
    """A called loader whose epoch has no batch (fewer samples than ``batch_size``) raises
    `DataLoaderConfigError` at each call and leaves ``epoch`` as it was (it counted up by 2
    a failing call); once the dataset has grown, the call serves that epoch."""
    ds = Encoded(3)

    def fn():
        loader = sf.data.DataLoader(ds, 4, sf.placement("cpu", [0]), seed=SEED, workers=0)
        loader.set_epoch(5)
        epochs = []
        for _ in range(2):
            with pytest.raises(sf.errors.DataLoaderConfigError, match="has no batch in an epoch"):
                loader()
            epochs.append(loader.epoch)
        ds.n = 8
        return epochs, _labels(loader()), loader.epoch

    assert sf.launch(fn, 1)[0] == ([5, 5], _want(8, 4, 5)[0], 5)
