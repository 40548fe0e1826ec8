"""``sf.data.DataLoader``: the batches of a map-style dataset as global tensors on a placement.

Every rank runs the loader and reads only the samples of its shard of each logical batch; the
batches are the same whatever the placement (`batch_order`). Worker processes
(`worker_pool.WorkerPool`; one a rank by default, where the platform forks) or a background
thread a rank (`prefetch.Prefetcher`, ``workers=0``) load at most ``prefetch`` batches ahead;
the global tensors are made on the consumer with `from_local` (no communication). Called
(``loader()``), it gives the next batch and goes on into the next epoch; inside an
``sf.nn.Graph``'s ``build`` that call is the graph's loading actor. See docs/runtime.md,
'Data loading'.
"""

from __future__ import annotations

import multiprocessing
import sys
import threading
from functools import partial
from typing import Any

import torch

from ..comm import at_rank_exit, current, rank_local
from ..errors import DataLoaderConfigError, DataLoaderError
from ..placement import Placement
from ..sbp import Partial, S, SbpLike, format_nd_sbp, parse_nd_sbp
from ..tensor import GlobalTensor, from_local, source
from .batch_order import batch_indices, num_batches, row_range
from .collate import Shards, apply_cut, cut_rule, read_samples, reading_index, stack_samples
from .prefetch import Prefetcher
from .worker_pool import STALE, WorkerPool

__all__ = ["DataLoader", "LoaderIterator"]


def _positive_int(name: str, value: Any, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise DataLoaderConfigError(f"DataLoader: {name} must be an int >= {minimum}, got "
                                    f"{value!r}")
    return value


def _workers(workers: Any, prefetch: int) -> int:
    """The loading processes a rank: ``workers`` as given, or for ``None`` (the default) one
    where a forked process can load, else 0 (the loading thread). A thread's Python (the
    dataset's ``__getitem__``, stacking) runs under the rank's GIL and adds to every step;
    a process runs beside it (benchmarks/loader.py: a thread cannot reach 0.95 of the
    in-memory throughput on a step of Python dispatch, a process does). No process off Linux
    (no fork, or an unsafe one), when CUDA is initialised in this process (a forked child
    cannot use it) or with ``prefetch=0`` (asked for: each batch on demand, in the caller's
    thread)."""
    if workers is None:  # macOS offers fork, but a forked child of threads may crash there
        forks = sys.platform.startswith("linux") and \
            "fork" in multiprocessing.get_all_start_methods()
        return int(prefetch > 0 and forks and not torch.cuda.is_initialized())
    return _positive_int("workers", workers, 0)


def _check_dataset(dataset: Any) -> None:
    if isinstance(dataset, torch.utils.data.IterableDataset) or not (
            hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise DataLoaderConfigError(
            f"DataLoader needs a map-style dataset (__getitem__ and __len__), got "
            f"{type(dataset).__name__}; an IterableDataset has no index to shard by")


class DataLoader:
    """Batches of ``batch_size`` samples of ``dataset`` (any object with ``__getitem__`` and
    ``__len__``) as global tensors on ``placement`` laid out as ``sbp`` (``S(0)``: each rank
    its rows; ``B``: every rank the whole batch; nd-sbps on N-D meshes). Yields a tuple of
    global tensors when the dataset's items are tuples / lists, else one.

    The order of an epoch is a permutation seeded with ``seed + epoch`` (``shuffle``), the
    same on every placement; `set_epoch` changes it, as for torch's ``DistributedSampler``
    (iterating again without `set_epoch` repeats the order). Every sample appears once an
    epoch; ``drop_last=False`` keeps a last smaller batch. ``prefetch`` batches are loaded
    ahead on a background thread (``0``: on demand, in the caller's thread); a wait for the
    thread is bounded by ``timeout`` (default the world's collective timeout,
    ``SBPFLOW_TIMEOUT``). ``workers=k > 0`` loads in ``k`` forked processes a rank instead
    (kept from epoch to epoch, at most ``max(prefetch, 1)`` batches ahead), as torch's
    ``num_workers``: the dataset's Python then runs beside the rank's, not under its GIL, and
    reads the forked copy of the dataset. The default (``workers=None``) is one process a rank
    where that works (`_workers`: the platform forks, CUDA is not initialised, ``prefetch >
    0``), else the thread; ``workers=0`` asks for the thread (the rank's own dataset object).
    """

    def __init__(self, dataset: Any, batch_size: int, placement: Placement,
                 sbp: SbpLike = S(0), shuffle: bool = True, seed: int = 0,
                 drop_last: bool = True, prefetch: int = 2,
                 timeout: float | None = None, workers: int | None = None) -> None:
        _check_dataset(dataset)
        if not isinstance(placement, Placement):
            raise DataLoaderConfigError(f"DataLoader: expected an sf.placement, got "
                                        f"{placement!r}")
        nd = parse_nd_sbp(sbp, placement.ndim)
        if any(isinstance(s, Partial) for s in nd):
            raise DataLoaderConfigError(
                f"DataLoader: sbp {format_nd_sbp(nd)} on {placement} is partial; loaded data "
                f"is split or broadcast (load with B and convert with to_global if needed)")
        if timeout is not None and not timeout > 0:
            raise DataLoaderConfigError(f"DataLoader: timeout must be > 0 s, got {timeout!r}")
        self.dataset, self.placement, self.sbp = dataset, placement, nd
        self.batch_size = _positive_int("batch_size", batch_size, 1)
        self.prefetch = _positive_int("prefetch", prefetch, 0)
        self.workers = _workers(workers, self.prefetch)
        self._pools: dict[int, WorkerPool] = {}  # a rank's worker processes (workers > 0)
        self._pools_lock = threading.Lock()
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise DataLoaderConfigError(f"DataLoader: seed must be an int, got {seed!r}")
        self.seed = seed
        self.shuffle, self.drop_last, self.timeout = bool(shuffle), bool(drop_last), timeout
        self.epoch = 0
        # what `__call__` reads, a feed a rank: a loader made outside `sf.launch` may be
        # called by every rank thread, each with its own position in its own epoch
        self._feeds: dict[int, LoaderIterator] = {}
        # the rank thread that made the loader: `__call__`'s loading threads live as long as
        # it does (a graph calls it from its loading actor's thread, which ends with each call)
        self._owner = threading.current_thread()

    def __call__(self):
        """The next batch, going on into the next epoch (``epoch + 1``) at the end of one.
        Inside a graph's ``build`` this is a data source: the graph loads one batch a call in
        its loading actor and hands each micro-batch its rows."""
        return source(self._next_batch)

    def _next_batch(self):
        """The calling rank's next called batch. An epoch's last batch starts the next
        epoch's feed at once, so its loading (``prefetch`` batches, as within an epoch) runs
        while the caller trains on that batch instead of after (a rank waited 1-4 ms at each
        epoch's first batch); ``epoch`` still counts up at the call that takes the next
        epoch's first batch, and `set_epoch` to another epoch drops that feed. An epoch
        without batches raises and leaves ``epoch`` as it was."""
        rank = current().rank
        feed = self._feeds.get(rank)
        if feed is None or feed.abandoned:  # abandoned: a fresh feed takes the workers back
            feed = LoaderIterator(self, owner=self._owner,
                                  epoch=None if feed is None else feed.epoch)
        elif feed.exhausted:  # the next epoch's feed did not start at the last batch: retried
            feed = LoaderIterator(self, owner=self._owner, epoch=feed.epoch + 1)
        if not len(feed):  # not kept: the next call looks at the dataset's length again
            raise DataLoaderConfigError(f"DataLoader: {self!r} has no batch in an epoch "
                                        f"(fewer samples than batch_size with drop_last?)")
        self._feeds[rank] = feed
        batch = next(feed)
        self.epoch = feed.epoch
        if feed.exhausted:
            self._start_next(rank, feed.epoch + 1)
        return batch

    def _start_next(self, rank: int, epoch: int) -> None:
        """The called feed of ``epoch`` (the next one), started ahead. A failure to start it
        (a worker process that has ended) is left to the next call, which retries and
        raises it: this call has its batch."""
        try:
            self._feeds[rank] = LoaderIterator(self, owner=self._owner, epoch=epoch)
        except DataLoaderError:
            pass

    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s order from the next iteration on (call it on every rank). The
        calling rank's called feed (every rank's, called outside a rank thread) of another
        epoch, or with no batch left, is dropped: its next call starts epoch ``epoch`` (not
        the one after it)."""
        self.epoch = _positive_int("epoch", epoch, 0)
        comm = rank_local().comm
        for rank in [comm.rank] if comm is not None else list(self._feeds):
            feed = self._feeds.get(rank)
            if feed is not None and (feed.epoch != self.epoch or feed.exhausted):
                feed.close()
                self._feeds.pop(rank, None)

    def __len__(self) -> int:
        return num_batches(len(self.dataset), self.batch_size, self.drop_last)

    def __iter__(self) -> "LoaderIterator":
        return LoaderIterator(self)

    def __repr__(self) -> str:
        return (f"DataLoader({type(self.dataset).__name__} of {len(self.dataset)}, "
                f"batch_size={self.batch_size}, {self.placement}, "
                f"sbp={format_nd_sbp(self.sbp)}, shuffle={self.shuffle}, seed={self.seed}, "
                f"epoch={self.epoch}, drop_last={self.drop_last}, prefetch={self.prefetch}"
                + (f", workers={self.workers})" if self.workers else ")"))

    def close(self) -> None:
        """End the worker processes (``workers > 0``; also done when the loader is garbage
        and, on a launched rank, when the rank's function ends); a later epoch forks new ones. An epoch under way (an iterator, a called feed) loads
        its remaining batches in a loading thread (`LoaderIterator`)."""
        with self._pools_lock:
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.close()

    def _pool(self, rank: int, length: int) -> WorkerPool:
        """The rank's worker processes, forked at its first epoch and kept while the dataset
        has the ``length`` it had at the fork: the workers' forked copy keeps that length, so
        their epoch order would be the old length's (a grown dataset's new indices never
        read, a shrunk one's gone indices read); another length forks new workers, and so
        does an epoch after the pool was closed. On a launched rank the pool is closed when
        the rank's function ends (`at_rank_exit`), normally or by an exception: the workers
        do not wait for the loader to be garbage (a traceback the caller keeps holds it)."""
        with self._pools_lock:
            pool = self._pools.get(rank)
            if pool is not None and (pool.closed or pool.tag != length):
                pool.close()  # its feeds under way are stale: they load their rest in a thread
                pool = None
            if pool is None:
                pool = self._pools[rank] = WorkerPool(
                    self.workers, partial(_BatchJob, self, rank), f"sbpflow-data-rank{rank}",
                    max(self.prefetch, 1), tag=length)
                at_rank_exit(pool.close)  # held weakly: a dropped loader still closes at once
            return pool


class _BatchJob:
    """Loads batch ``b`` of one epoch for one rank: its rows' samples, stacked and cut into
    `Shards`. Holds no reference to the iterator (the loading thread runs it)."""

    def __init__(self, loader: DataLoader, rank: int, epoch: int | None = None) -> None:
        self.dataset, self.placement, self.sbp = loader.dataset, loader.placement, loader.sbp
        self.rank = rank
        self.epoch = loader.epoch if epoch is None else epoch
        self.coord = loader.placement.coord_of(rank) if rank in loader.placement else None
        self.length = len(loader.dataset)
        self.batches = batch_indices(self.length, loader.batch_size,
                                     shuffle=loader.shuffle, seed=loader.seed,
                                     epoch=self.epoch, drop_last=loader.drop_last)
        self.progress: dict = {"batch": None, "index": None}
        # the row range and the cuts depend on the batch's size (and the items' shapes) only:
        # computed once, not per batch (the loading thread's Python competes for the GIL)
        self._rows: dict[int, tuple] = {}
        self._cuts: dict[tuple, tuple] = {}

    def __call__(self, b: int) -> Shards:
        indices = self.batches[b]
        n = len(indices)
        rows = self._rows.get(n)
        if rows is None:
            rows = self._rows[n] = row_range(n, self.placement, self.sbp, self.coord)
        start, size = rows
        where = f"batch {b} of epoch {self.epoch} on rank {self.rank}"
        self.progress["batch"], self.progress["index"], self.progress["reading"] = b, None, None
        # a rank whose shard is empty still needs the items' shapes and dtypes: it reads the
        # batch's first sample (the only read outside its shard)
        mine = indices[start:start + size] or indices[:1]
        samples = read_samples(self.dataset, mine, where, self.progress)
        form, stacked = stack_samples(samples, mine, where)
        locals_, shapes = [], []
        for k, value in enumerate(stacked):
            if not size:  # an empty shard: the one sample read was for shapes and dtypes
                value = value[:0]
            key = (n, k, tuple(value.shape))
            rule = self._cuts.get(key)
            if rule is None:
                rule = self._cuts[key] = cut_rule(key[2], n, self.placement, self.sbp,
                                                  self.coord)
            locals_.append(apply_cut(value, rule[1]))
            shapes.append(rule[0])
        self.progress["batch"] = None
        return Shards(form, tuple(locals_), tuple(shapes))

    def describe(self) -> str:
        p = self.progress
        if p["batch"] is None:
            return "waiting for a free prefetch slot or idle"
        return (f"reading sample(s) {reading_index(p)} of batch {p['batch']} "
                f"(epoch {self.epoch})")


def _timeout(loader: DataLoader, comm: Any) -> float:
    """The loader's own timeout, else the communicator's (`Communicator.wait_timeout`)."""
    return float(loader.timeout) if loader.timeout is not None else comm.wait_timeout()


class LoaderIterator:
    """One pass over an epoch's batches on the calling rank. Closing it (`close`, or dropping
    the last reference to it) stops its loading thread.

    With worker processes, a new iteration of the same loader on the rank takes the rank's
    workers over (the common case, a finished or abandoned epoch, stays as fast); an iterator
    whose feed has gone stale that way, or by `DataLoader.close`, loads its remaining batches
    in a loading thread of its own, as ``workers=0`` does (`_load`): two iterators of one
    loader (``zip(loader, loader)``, an inner loop) give the same batches as with a thread."""

    def __init__(self, loader: DataLoader, owner: threading.Thread | None = None,
                 epoch: int | None = None) -> None:
        comm = current()
        loader.placement.check_world(comm.world_size)
        self._loader = loader  # keeps the loader alive while iterating
        self._job = _BatchJob(loader, comm.rank, epoch)  # epoch None: the loader's
        self._count, self._next, self._done = len(self._job.batches), 0, False
        self._owner, self._timeout = owner, _timeout(loader, comm)
        self._prefetcher = None
        if loader.workers > 0 and self._count > 0:
            self._prefetcher = loader._pool(comm.rank, self._job.length).feed(
                self._job.epoch, self._count, loader.prefetch, self._timeout)
        elif self._count > 0:
            self._prefetcher = self._thread(0)

    def _thread(self, start: int) -> Prefetcher | None:
        """A loading thread for batches ``start..`` (None with ``prefetch=0``: on demand)."""
        if not self._loader.prefetch:
            return None
        return Prefetcher(self._job, self._count, self._loader.prefetch,
                          f"sbpflow-data-rank{self._job.rank}", self._timeout,
                          self._job.describe, self._owner, start=start)

    def __iter__(self) -> "LoaderIterator":
        return self

    def __len__(self) -> int:
        return self._count

    @property
    def epoch(self) -> int:
        """The epoch whose order this iterator serves."""
        return self._job.epoch

    @property
    def abandoned(self) -> bool:
        """No batch taken yet, and its worker processes have gone on to another feed (an
        iteration of the same loader on this rank started since): it would wait for
        batches that will never come."""
        return self._next == 0 and getattr(self._prefetcher, "stale", False)

    @property
    def exhausted(self) -> bool:
        """No batch left (the next ``next`` raises StopIteration)."""
        return self._done or self._next >= self._count

    def __next__(self):
        if self.exhausted:
            self.close()
            raise StopIteration
        b = self._next
        self._next += 1
        try:
            shards = self._load(b)
        except BaseException:
            self.close()
            raise
        pl, nd = self._loader.placement, self._loader.sbp
        if self._job.coord is None:  # outside the placement: from_local makes the empty shard
            out = tuple(from_local(t, pl, nd, shape=s)
                        for t, s in zip(shards.locals, shards.shapes))
        else:  # the shards were cut by the layout's rule (`cut_rule`): nothing to check again
            out = [GlobalTensor(t, s, pl, nd) for t, s in zip(shards.locals, shards.shapes)]
        return shards.form.build(out)

    def _load(self, b: int) -> Shards:
        """Batch ``b``: from the feed, or, once a worker feed is stale (`STALE`), from a
        loading thread started at ``b`` (never a wait for batches that will not come)."""
        feed = self._prefetcher
        if feed is None:
            return self._job(b)
        shards = feed.get(b)
        if shards is STALE:
            feed = self._prefetcher = self._thread(b)
            shards = feed.get(b) if feed is not None else self._job(b)
        return shards

    def close(self) -> None:
        """Stop loading (the loading thread finishes the sample it is reading, if any)."""
        self._done = True
        if self._prefetcher is not None and hasattr(self._prefetcher, "close"):
            self._prefetcher.close()  # (a worker feed needs no closing: the next one's
            # generation makes its workers drop what is left of it)
