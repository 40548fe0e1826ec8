"""sf.data.DataLoader: every rank reads only its shard's samples and the global batches equal
torch's own one-device batches (DistributedSampler with one replica + BatchSampler +
default_collate) in order, for 1-D / 2-D meshes, split and broadcast layouts, uneven batches
and both drop_last; the order is independent of the placement, set_epoch changes it as
torch's; prefetching stays within its budget; loading errors and timeouts reach the consumer;
abandoned loading threads stop; a training loop fed by the loader equals one fed from memory."""

from __future__ import annotations

import gc
import sys
import threading
import time

import pytest
import torch

import sbpflow as sf
from loader_fns import WIDTH, Encoded, full_batches
from sbpflow.sbp import parse_nd_sbp

SEED = 7


def torch_batches(ds, batch_size: int, epoch: int = 0, drop_last: bool = False,
                  shuffle: bool = True, seed: int = SEED) -> tuple[list, list]:
    """(index batches, collated batches) of torch's DataLoader on one device."""
    sampler = torch.utils.data.DistributedSampler(ds, num_replicas=1, rank=0, shuffle=shuffle,
                                                  seed=seed)
    sampler.set_epoch(epoch)
    batch_sampler = torch.utils.data.BatchSampler(sampler, batch_size, drop_last)
    values = list(torch.utils.data.DataLoader(ds, batch_sampler=batch_sampler))
    return list(batch_sampler), [v if isinstance(v, list) else [v] for v in values]


def _launch_loader(ds, batch_size, ranks, sbp, world, drop_last, prefetch, epoch=0,
                   workers=None):
    """Per rank: [(full value, local shard, sbp, shape) per element] per batch, len(loader)."""
    pl = sf.placement("cpu", ranks)

    def fn():
        loader = sf.data.DataLoader(ds, batch_size, pl, sbp=sbp, seed=SEED,
                                    drop_last=drop_last, prefetch=prefetch, workers=workers)
        loader.set_epoch(epoch)
        out = []
        for batch in loader:
            items = batch if isinstance(batch, tuple) else (batch,)
            out.append([(t.full_tensor(), t.local.clone(), t.sbp, t.shape) for t in items])
        return out, len(loader)

    return pl, sf.launch(fn, world)


# (ranks, sbp, world, n, batch_size, tuple items)
LAYOUTS = {
    "1d-S0": ([0, 1, 2, 3], sf.S(0), 4, 22, 6, True),            # rows 2,2,1,1; last 4
    "1d-B": ([0, 1, 2, 3], sf.B, 4, 22, 6, True),
    "1d-S0-fewer-rows": ([0, 1, 2, 3], sf.S(0), 4, 11, 3, True),  # rank 3 has no rows
    "2d-S0,B": ([[0, 1], [2, 3]], (sf.S(0), sf.B), 4, 22, 5, True),
    "2d-B,S0": ([[0, 1], [2, 3]], (sf.B, sf.S(0)), 4, 22, 5, True),
    "2d-S0,S0": ([[0, 1], [2, 3]], (sf.S(0), sf.S(0)), 4, 22, 7, True),
    "2d-S0,S1": ([[0, 1], [2, 3]], (sf.S(0), sf.S(1)), 4, 22, 5, False),
    "1d-S1": ([0, 1, 2], sf.S(1), 3, 10, 4, False),
    "rank-outside": ([1, 2], sf.S(0), 3, 10, 3, True),
}


def _check_reads(all_reads, pl, index_batches, results) -> None:
    """Each rank read, for each batch, exactly the samples its shard holds (whose index its
    values encode) — or, with no rows, the batch's first sample (for the shapes) — each once;
    the ranks together read the whole batch."""
    for b, idx in enumerate(index_batches):
        union = set()
        for r, (batches, _) in enumerate(results):
            reads = [i for rr, i in all_reads if rr == r and i in set(idx)]
            local = batches[b][0][1]
            held = set((local // 100).long().flatten().tolist()) if r in pl else set()
            want = held if held else {idx[0]}
            assert sorted(reads) == sorted(want), (b, r, reads, want)
            union |= held
        assert union == set(idx), (b, union, idx)


# (prefetch, workers): on demand in the rank thread, a loading thread, the default (a
# loading process a rank where the platform forks)
FEEDS = {"on-demand": (0, None), "thread": (2, 0), "default": (2, None)}


@pytest.mark.parametrize("feed", list(FEEDS))
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_batches_equal_torch_and_ranks_read_their_shard(name, drop_last, feed, tmp_path):
    ranks, sbp, world, n, bs, tuples = LAYOUTS[name]
    index_batches, ref = torch_batches(Encoded(n, tuples), bs, drop_last=drop_last)
    assert len(ref[-1][0]) != bs or drop_last   # the last batch is a smaller one
    ds = Encoded(n, tuples, log=str(tmp_path / "reads"))
    prefetch, workers = FEEDS[feed]
    pl, results = _launch_loader(ds, bs, ranks, sbp, world, drop_last, prefetch,
                                 workers=workers)
    nd = parse_nd_sbp(sbp, pl.ndim)
    for batches, length in results:
        assert length == len(ref) == len(batches)
        for got, want in zip(batches, ref):
            assert len(got) == len(want) == (2 if tuples else 1)
            for (full, _, t_sbp, shape), value in zip(got, want):
                assert t_sbp == nd and tuple(shape) == tuple(value.shape)
                assert full.dtype == value.dtype and torch.equal(full, value)
    _check_reads(ds.logged_reads(), pl, index_batches, results)


def test_split_of_a_scalar_element_names_its_shape():
    pl = sf.placement("cpu", [0])
    loader = sf.data.DataLoader(Encoded(6), 3, pl, sbp=sf.S(1))   # labels are (3,)
    with pytest.raises(sf.errors.SplitAxisError, match=r"\(3,\)"):
        next(iter(loader))


def test_same_order_whatever_the_placement():
    ds = Encoded(23)

    def fn():
        outs = []
        for ranks, sbp in (([0, 1, 2, 3], sf.S(0)), ([[0, 1], [2, 3]], (sf.B, sf.S(0))),
                           ([2], sf.S(0))):
            loader = sf.data.DataLoader(ds, 4, sf.placement("cpu", ranks), sbp=sbp, seed=3)
            loader.set_epoch(2)
            outs.append([y.full_tensor() for _, y in loader])
        return outs

    for outs in sf.launch(fn, 4):
        assert len(outs[0]) == 5
        for other in outs[1:]:
            assert all(torch.equal(a, b) for a, b in zip(outs[0], other))
        _, ref = torch_batches(ds, 4, epoch=2, drop_last=True, seed=3)
        assert all(torch.equal(a, b[1]) for a, b in zip(outs[0], ref))


def _labels(loader) -> list[list[int]]:
    return [y.full_tensor().tolist() for _, y in loader]


@pytest.mark.parametrize("drop_last", [False, True])
def test_every_sample_once_an_epoch(drop_last):
    n, bs = 29, 4

    def fn():
        loader = sf.data.DataLoader(Encoded(n), bs, sf.placement("cpu", [0, 1, 2]),
                                    drop_last=drop_last)
        epochs = []
        for e in range(3):
            loader.set_epoch(e)
            epochs.append(_labels(loader))
        return epochs, len(loader)

    for epochs, length in sf.launch(fn, 3):
        assert length == (7 if drop_last else 8)
        for batches in epochs:
            seen = [i for b in batches for i in b]
            assert len(seen) == len(set(seen)) == (28 if drop_last else 29)
            assert [len(b) for b in batches] == [4] * 7 + ([] if drop_last else [1])
        assert epochs[0] != epochs[1] != epochs[2]


def test_set_epoch_with_called_batches_serves_that_epoch():
    """The usual loop with ``loader()`` (as in a graph's build): ``set_epoch(e)`` then
    ``len(loader)`` calls give epoch ``e``'s batches, also right after the last batch of an
    epoch (the exhausted feed used to roll on and serve epoch e + 1); without ``set_epoch``
    the calls go on into the next epoch; set mid-epoch, the new epoch starts at once."""
    ds = Encoded(20)

    def fn():
        loader = sf.data.DataLoader(ds, 5, sf.placement("cpu", [0, 1]))
        called = []
        for epoch in range(3):
            loader.set_epoch(epoch)
            called.append([loader()[1].full_tensor().tolist() for _ in range(len(loader))])
        rolled = [loader()[1].full_tensor().tolist() for _ in range(len(loader))]
        loader()                      # a batch of epoch 4, then epoch 1 from its start
        loader.set_epoch(1)
        restarted = [loader()[1].full_tensor().tolist() for _ in range(len(loader))]
        return called, rolled, restarted, loader.epoch

    called, rolled, restarted, epoch = sf.launch(fn, 2)[0]
    ref = [[r[1].tolist() for r in torch_batches(ds, 5, epoch=e, seed=0)[1]] for e in range(4)]
    assert called == ref[:3] and rolled == ref[3] and restarted == ref[1]
    assert epoch == 1


def test_set_epoch_changes_the_order_deterministically():
    ds = Encoded(20)

    def fn():
        a = sf.data.DataLoader(ds, 5, sf.placement("cpu", [0, 1]))
        b = sf.data.DataLoader(ds, 5, sf.placement("cpu", [0, 1]), sbp=sf.B)
        first, again = _labels(a), _labels(a)        # no set_epoch: the same order again
        a.set_epoch(1)
        b.set_epoch(1)
        return first, again, _labels(a), _labels(b)

    first, again, one_a, one_b = sf.launch(fn, 2)[0]
    assert first == again and one_a == one_b and one_a != first
    for epoch, got in ((0, first), (1, one_a)):
        _, ref = torch_batches(ds, 5, epoch=epoch, seed=0)   # the loaders' default seed
        assert got == [r[1].tolist() for r in ref]
    no_shuffle = sf.data.DataLoader(ds, 5, sf.placement("cpu", [0]), shuffle=False)
    assert _labels(no_shuffle) == [list(range(i, i + 5)) for i in range(0, 20, 5)]


def _batch_of(index_batches) -> dict[int, int]:
    return {i: b for b, idx in enumerate(index_batches) for i in idx}


def _ahead(ds, rank: int, batch_of: dict) -> int:
    """The last batch of which ``rank`` has read a sample (-1: none)."""
    return max((batch_of[i] for r, i in list(ds.reads) if r == rank), default=-1)


def _parked(thread: threading.Thread) -> bool:
    """``thread`` has ended or sits in a ``threading`` wait (a lock, semaphore, event or
    condition with nothing to take): it cannot read another sample until it is woken."""
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "wait" and code.co_filename == threading.__file__:
            return True
        frame = frame.f_back
    return not thread.is_alive()


def _settle(ds, rank: int, batch_of: dict, want: int, thread) -> int:
    """Once the loading thread (None: no thread) has read batch ``want`` and then parked
    (waiting for a slot) or ended: the last batch it has read from (`_ahead`). Gives up after
    30 s (a thread that does not run ahead, or never parks)."""
    deadline = time.monotonic() + 30
    while _ahead(ds, rank, batch_of) < want and time.monotonic() < deadline:
        time.sleep(0.005)
    while thread is not None and not _parked(thread) and time.monotonic() < deadline:
        time.sleep(0.005)
    return _ahead(ds, rank, batch_of)


@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_prefetch_loads_at_most_its_budget_ahead(prefetch):
    """While the consumer holds batch k the loading thread reads up to batch k + prefetch and
    no further: checked once it has parked, so an overrun would already have been read."""
    n, bs = 40, 4
    index_batches, _ = torch_batches(Encoded(n), bs)
    batch_of, ds = _batch_of(index_batches), Encoded(n)

    def fn():
        me, seen = sf.rank(), []
        loader = sf.data.DataLoader(ds, bs, sf.placement("cpu", [0, 1]), seed=SEED,
                                    prefetch=prefetch, workers=0)   # the loading thread
        before = set(threading.enumerate())
        thread = None
        for k, _ in enumerate(loader):
            if k == 0:   # it cannot have ended yet: the last batch is more than a budget away
                mine = [t for t in set(threading.enumerate()) - before
                        if t.name == f"sbpflow-data-rank{me}"]
                assert len(mine) == (1 if prefetch else 0), mine
                thread = mine[0] if mine else None
            want = min(k + prefetch, len(index_batches) - 1)
            seen.append((k, _settle(ds, me, batch_of, want, thread)))
        return seen

    for seen in sf.launch(fn, 2):
        assert seen == [(k, min(k + prefetch, 9)) for k in range(10)]


def test_a_failing_sample_raises_on_the_consumer_naming_it():
    ds = Encoded(16, fail_at=13)
    index_batches, _ = torch_batches(Encoded(16), 4)
    bad_batch = _batch_of(index_batches)[13]

    for prefetch, workers in FEEDS.values():  # the cause reaches the consumer in every mode
        yielded = []

        def fn():
            loader = sf.data.DataLoader(ds, 4, sf.placement("cpu", [0]), seed=SEED,
                                        prefetch=prefetch, workers=workers)
            try:
                for _ in loader:
                    yielded.append(1)
            finally:
                loader.close()

        with pytest.raises(sf.errors.DataLoaderError, match=rf"sample 13 \(batch {bad_batch} of "
                                                     rf"epoch 0 on rank 0\)") as info:
            sf.launch(fn, 1)
        assert isinstance(info.value.__cause__, ValueError)
        assert len(yielded) == bad_batch


def _data_threads() -> set:
    return {t for t in threading.enumerate() if t.name.startswith("sbpflow-data")}


def _stopped(threads, seconds: float = 30.0) -> bool:
    """All ``threads`` end within ``seconds`` (generous: join returns as soon as they do)."""
    for t in threads:
        t.join(seconds)
    return not any(t.is_alive() for t in threads)


def test_abandoned_iteration_stops_its_thread():
    pl = sf.placement("cpu", [0])
    before = _data_threads()
    it = iter(sf.data.DataLoader(Encoded(50), 2, pl, workers=0))   # the loader is garbage too
    next(it)
    started = _data_threads() - before
    assert len(started) == 1 and all(t.is_alive() for t in started)
    del it
    gc.collect()
    assert _stopped(started)
    loader = sf.data.DataLoader(Encoded(50), 2, pl, workers=0)
    for _ in loader:                                    # a loop left by break
        break
    assert _stopped(_data_threads() - before)
    it = iter(loader)
    next(it)
    it.close()
    assert _stopped(_data_threads() - before)
    assert len(list(loader)) == 25 and _stopped(_data_threads() - before)


def test_the_thread_stops_when_its_rank_ends():
    """An iterator that outlives its rank thread (returned by it) stops loading."""
    before = _data_threads()

    def fn():
        it = iter(sf.data.DataLoader(Encoded(50), 2, sf.placement("cpu", [0, 1]), workers=0))
        next(it)
        return it

    iterators = sf.launch(fn, 2)
    assert all(it is not None for it in iterators)
    assert _stopped(_data_threads() - before)


def test_a_hung_sample_times_out_naming_it():
    """Sample 3 hangs (30 s, unless released): the consumer's 0.3 s timeout fires long before
    (< 10 s) and names it."""
    release = threading.Event()

    class Hung(Encoded):
        def __getitem__(self, i):
            if i == 3:
                release.wait(30)
            return super().__getitem__(i)

    loader = sf.data.DataLoader(Hung(8), 8, sf.placement("cpu", [0]), shuffle=False,
                                timeout=0.3, workers=0)
    start = time.monotonic()
    try:
        with pytest.raises(sf.errors.DataLoaderError, match=r"waited 0.3 s for batch 0 .*reading "
                                                     r"sample\(s\) 3 of batch 0"):
            next(iter(loader))
        elapsed = time.monotonic() - start
    finally:
        release.set()                   # the loading thread finishes its read and stops
    assert 0.3 <= elapsed < 10


def test_bad_arguments_and_samples():
    pl = sf.placement("cpu", [0])
    for kwargs in ({"batch_size": 0}, {"prefetch": -1}, {"sbp": sf.P}, {"timeout": 0}):
        args = {"batch_size": 2, **kwargs}
        with pytest.raises(sf.errors.DataLoaderConfigError):
            sf.data.DataLoader(Encoded(4), placement=pl, **args)

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(3))

    with pytest.raises(sf.errors.DataLoaderConfigError, match="map-style"):
        sf.data.DataLoader(Stream(), 2, pl)
    ragged = [torch.zeros(3), torch.zeros(4)]
    with pytest.raises(sf.ShapeError, match=r"sample 1 has shape \(4,\) but sample 0 has \(3,\)"):
        next(iter(sf.data.DataLoader(ragged, 2, pl, shuffle=False)))
    pairs = [(0, torch.zeros(3)), (1, torch.zeros(3)), (2, torch.zeros(2, 3))]
    with pytest.raises(sf.ShapeError, match=r"sample 2 element 1 has shape \(2, 3\)"):
        next(iter(sf.data.DataLoader(pairs, 3, pl, shuffle=False)))
    mixed = [torch.zeros(3), torch.zeros(3, dtype=torch.int64)]   # torch.stack would promote
    with pytest.raises(sf.errors.DtypeMismatchError, match="sample 1 is torch.int64 but sample 0"):
        next(iter(sf.data.DataLoader(mixed, 2, pl, shuffle=False)))
    with pytest.raises(sf.errors.DataLoaderError, match="sample 1 .* is one value but sample 0 is a "
                                                 "tuple of 2"):
        next(iter(sf.data.DataLoader([(1, 2), 3], 2, pl, shuffle=False)))
    with pytest.raises(sf.errors.DataLoaderError, match="sample 1 .* is a str"):
        next(iter(sf.data.DataLoader([1, "a"], 2, pl, shuffle=False, prefetch=0)))


def test_single_values_numbers_and_getitems():
    """Numbers collate as torch's default_collate (int64, float64); a dataset's __getitems__
    is used when it has one."""

    class Batched(Encoded):
        calls = []

        def __getitems__(self, indices):
            self.calls.append(list(indices))
            return [(float(i), i, bool(i % 2)) for i in indices]

    pl = sf.placement("cpu", [0])
    x, i, odd = next(iter(sf.data.DataLoader(Batched(6), 3, pl, shuffle=False, workers=0)))
    assert (x.dtype, i.dtype, odd.dtype) == (torch.float64, torch.int64, torch.bool)
    assert x.local.tolist() == [0.0, 1.0, 2.0] and Batched.calls[0] == [0, 1, 2]
    single = next(iter(sf.data.DataLoader(Encoded(6, tuples=False), 3, pl, shuffle=False)))
    assert isinstance(single, sf.GlobalTensor) and single.shape == (3, WIDTH)


class Labelled(torch.utils.data.Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def _train(pl, batches_of_epoch, epochs: int) -> dict:
    """Data-parallel training of a small MLP (float64) on the batches ``batches_of_epoch(e)``
    gives; returns the final weights."""
    sf.manual_seed(0)
    model = sf.nn.Sequential(sf.nn.Linear(6, 8), sf.nn.ReLU(), sf.nn.Linear(8, 3)).double()
    sf.parallel.apply(model, pl, {"*": sf.B})
    opt = sf.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for e in range(epochs):
        for x, y in batches_of_epoch(e):
            opt.zero_grad()
            sf.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}   # full torch tensors


def test_training_with_the_loader_equals_training_from_memory():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(30, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (30,))
    ds = Labelled(x, y)
    refs = [torch_batches(ds, 7, epoch=e)[0] for e in range(2)]   # index batches per epoch

    def fn():
        pl = sf.placement("cpu", [0, 1, 2])
        loader = sf.data.DataLoader(ds, 7, pl, seed=SEED, drop_last=False)

        def from_loader(e):
            loader.set_epoch(e)
            return loader

        def from_memory(e):
            return [(sf.tensor(x[idx], pl, sf.S(0)), sf.tensor(y[idx], pl, sf.S(0)))
                    for idx in refs[e]]

        return _train(pl, from_loader, 2), _train(pl, from_memory, 2), _train(pl, lambda e: [], 0)

    for fed, memory, initial in sf.launch(fn, 3):
        assert fed.keys() == memory.keys()
        assert all(torch.equal(fed[k], memory[k]) for k in fed)
        assert not torch.equal(fed["0.weight"], initial["0.weight"])   # it did train


@pytest.mark.gloo
def test_torch_backend_batches_equal_torch():
    n, bs = 13, 4
    ref_idx, ref = torch_batches(Encoded(n), bs, epoch=1, drop_last=False)
    results = sf.launch(full_batches, 2, backend="torch", args=(n, bs, 2, SEED, 1, False))
    for r, batches in enumerate(results):
        assert len(batches) == len(ref) == 4
        for (x, y, local_shape), (rx, ry), idx in zip(batches, ref, ref_idx):
            assert torch.equal(x, rx) and torch.equal(y, ry)
            rows = len(idx) // 2 + (1 if r < len(idx) % 2 else 0)
            assert local_shape == (rows, WIDTH)


@pytest.mark.parametrize("name", ["1d-S0", "2d-S0,S1", "rank-outside"])
def test_worker_processes_give_torchs_batches(name):
    """``workers=2``: the batches of two epochs (the processes kept between them, one epoch
    abandoned after a batch) equal torch's; closing the loader ends the processes."""
    ranks, sbp, world, n, bs, tuples = LAYOUTS[name]
    pl = sf.placement("cpu", ranks)
    nd = parse_nd_sbp(sbp, pl.ndim)
    ds = Encoded(n, tuples)

    def fn():
        loader = sf.data.DataLoader(ds, bs, pl, sbp=sbp, seed=SEED, drop_last=False,
                                    prefetch=1, workers=2)
        out = []
        for epoch in (0, 1):
            loader.set_epoch(epoch)
            next(iter(loader))  # abandoned: its workers drop what is left of it
            out.append([[(t.full_tensor(), t.sbp) for t in (b if tuples else (b,))]
                        for b in loader])
        procs = [p for pool in loader._pools.values() for p in pool.procs]
        loader.close()
        return out, procs

    for out, procs in sf.launch(fn, world):
        for epoch, got in enumerate(out):
            want = torch_batches(Encoded(n, tuples), bs, epoch=epoch)[1]
            assert len(got) == len(want)
            for g, w in zip(got, want):
                for (full, t_sbp), value in zip(g, w):
                    assert t_sbp == nd and full.dtype == value.dtype and torch.equal(full, value)
        for p in procs:
            p.join(10)
        assert procs and not any(p.is_alive() for p in procs)


def test_a_failing_sample_in_a_worker_process_raises_naming_it():
    index_batches, _ = torch_batches(Encoded(16), 4)
    bad_batch = _batch_of(index_batches)[13]
    yielded = []

    def fn():
        loader = sf.data.DataLoader(Encoded(16, fail_at=13), 4, sf.placement("cpu", [0]),
                                    seed=SEED, workers=1)
        try:
            for _ in loader:
                yielded.append(1)
        finally:
            loader.close()

    with pytest.raises(sf.errors.DataLoaderError, match=rf"worker process sbpflow-data-rank0-worker0"
                                                 rf".*sample 13 \(batch {bad_batch} of epoch 0 "
                                                 rf"on rank 0\)"):
        sf.launch(fn, 1)
    assert len(yielded) == bad_batch
