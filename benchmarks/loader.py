"""Throughput of a training step fed by ``sf.data.DataLoader`` vs the same step fed by batches
already in memory (issue 14's loader goal: >= 0.95 of the in-memory throughput).

The data is scikit-learn's digits (1797 images of 8x8, 10 classes; bundled with sklearn, no
download), read one sample at a time through a map-style dataset, as a torch user would. The
step is a data-parallel MLP (64 -> hidden -> hidden -> 10, SGD) on ``--ranks`` thread ranks,
the batch split ``S(0)``; one line per ``--hidden`` width: a small width makes a step of
Python dispatch (which holds the GIL, so the loading thread's Python cannot overlap it), a
large one a step of kernels (which release it, as device kernels would). The in-memory run
trains on the same batches, built as global tensors before the timed epochs. In graph mode
(``sf.nn.Graph``) the loader is called inside ``build``: a loading actor of the plan, against
the same graph called with in-memory batches. Epochs alternate the feeds in one process; the
medians are reported, with the process's CPU time (all ranks' threads: the work, which load
from other jobs on the machine changes less than the wall time; worker processes' CPU is
outside it). ``--backend torch`` runs the ranks as gloo processes instead, as deployed (each
rank's Python under its own GIL; the CPU time is then rank 0's process):

    .venv/bin/python benchmarks/loader.py [--ranks 2] [--batch 64] [--hidden 256,1024]
        [--epochs 3] [--rounds 3] [--prefetch 2] [--workers N] [--backend threads] [--consumer]

``--workers`` defaults to the loader's own default (one loading process a rank where the
platform forks); ``--workers 0`` measures the loading thread.

``--consumer`` prints instead what taking a batch costs the rank's thread (its CPU time in
``next(iterator)``, median of epochs), the loader iterated beside a 2 ms sleep for a step,
and what loading a batch costs (the loading thread's or a worker's work).
"""

from __future__ import annotations

import argparse
import statistics
import time
import timeit

import torch

import sbpflow as sf


class Digits(torch.utils.data.Dataset):
    """scikit-learn's digits: (64 float32 pixels scaled to [0, 1], int label) per sample."""

    def __init__(self) -> None:
        from sklearn.datasets import load_digits
        data = load_digits()
        self.x = torch.tensor(data.data, dtype=torch.float32) / 16.0
        self.y = torch.tensor(data.target, dtype=torch.int64)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], int(self.y[i])


def _model(pl, hidden: int):
    sf.manual_seed(0)
    model = sf.nn.Sequential(sf.nn.Linear(64, hidden), sf.nn.ReLU(),
                             sf.nn.Linear(hidden, hidden), sf.nn.ReLU(), sf.nn.Linear(hidden, 10))
    sf.parallel.apply(model, pl, {"*": sf.B})
    return model, sf.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _epoch(model, opt, batches) -> tuple[float, float, int]:
    """Wall seconds, the process's CPU seconds (every rank thread, runtime and loading thread
    of this process; not worker processes) and samples of one pass over ``batches``."""
    start, cpu, samples = time.perf_counter(), time.process_time(), 0
    for x, y in batches:
        opt.zero_grad()
        sf.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        samples += x.shape[0]
    return time.perf_counter() - start, time.process_time() - cpu, samples


def _graphs(model, opt, loader):
    """Two training steps in graph mode: one that loads its batch (``loader()`` in build: the
    plan's loading actor), one called with a batch."""
    def train(graph, x, y):
        loss = sf.nn.functional.cross_entropy(graph.model(x), y)
        loss.backward()
        return loss

    class Loading(sf.nn.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.add_optimizer(opt)

        def build(self):
            return train(self, *loader())

    class Fed(Loading):
        def build(self, x, y):
            return train(self, x, y)

    return Loading(), Fed()


def _graph_epoch(step, batches, count: int, batch: int) -> tuple[float, float, int]:
    """`_epoch` for a graph: ``count`` calls, fed ``batches`` (None: the graph loads)."""
    start, cpu = time.perf_counter(), time.process_time()
    if batches is None:
        for _ in range(count):
            step()
    else:
        for x, y in batches:
            step(x, y)
    return time.perf_counter() - start, time.process_time() - cpu, count * batch


def _in_memory(ds: Digits, loader, pl) -> list:
    """The loader's batches of its current epoch, built as global tensors beforehand."""
    order = sf.data.batch_indices(len(ds), loader.batch_size, shuffle=True, seed=loader.seed,
                                  epoch=loader.epoch, drop_last=loader.drop_last)
    return [(sf.tensor(ds.x[idx], pl, sf.S(0)), sf.tensor(ds.y[idx], pl, sf.S(0)))
            for idx in order]


def _rank(ds: Digits, args, hidden: int) -> dict:
    """On every rank: alternate loader-fed and memory-fed epochs; the per-epoch figures."""
    pl = sf.placement("cpu", list(range(args.ranks)))
    model, opt = _model(pl, hidden)
    loader = sf.data.DataLoader(ds, args.batch, pl, prefetch=args.prefetch,
                                workers=args.workers)
    _epoch(model, opt, loader)  # warm-up: dispatch caches, allocator
    loading, fed = _graphs(model, opt, sf.data.DataLoader(
        ds, args.batch, pl, prefetch=args.prefetch, workers=args.workers))
    memory = _in_memory(ds, loader, pl)
    n = len(memory)
    _graph_epoch(loading, None, 2, args.batch)  # compiles
    _graph_epoch(fed, memory[:2], 2, args.batch)
    times: dict = {"loader": [], "memory": [], "graph loader": [], "graph memory": []}
    for r in range(args.rounds):
        for e in range(args.epochs):
            loader.set_epoch(r * args.epochs + e)
            memory = _in_memory(ds, loader, pl)
            times["loader"].append(_epoch(model, opt, loader))
            times["memory"].append(_epoch(model, opt, memory))
            times["graph loader"].append(_graph_epoch(loading, None, n, args.batch))
            times["graph memory"].append(_graph_epoch(fed, memory, n, args.batch))
    return times


def _consumer(ds: Digits, args) -> tuple[float, float]:
    """On every rank: the rank thread's CPU microseconds a ``next()`` of the loader (median of
    8 epochs after 2 of warm-up; the step is a 2 ms sleep, so the batch is usually ready), and
    the loading of a batch itself (in the loading thread or a worker)."""
    pl = sf.placement("cpu", list(range(args.ranks)))
    loader = sf.data.DataLoader(ds, args.batch, pl, prefetch=args.prefetch,
                                workers=args.workers)
    costs = []
    for e in range(10):
        loader.set_epoch(e)
        it, cpu = iter(loader), 0.0
        for _ in range(len(it)):
            time.sleep(0.002)
            start = time.thread_time()
            next(it)
            cpu += time.thread_time() - start
        costs.append(cpu / len(it) * 1e6)
    loader.close()
    # the loading of one batch itself (read, stack, cut this rank's rows), warm, best of 5
    from sbpflow.data.dataloader import _BatchJob
    job = _BatchJob(loader, sf.comm.current().rank)
    load = min(timeit.repeat(lambda: job(0), number=100, repeat=5)) / 100 * 1e6
    return statistics.median(costs[2:]), load


def _report(times: dict) -> None:
    rate = {}
    for feed in ("memory", "loader", "graph memory", "graph loader"):
        wall = statistics.median(t for t, _, _ in times[feed])
        cpu = statistics.median(c for _, c, _ in times[feed])
        rate[feed] = times[feed][0][2] / wall
        print(f"  {feed:12s}: {wall * 1e3:7.1f} ms / epoch, process CPU {cpu * 1e3:7.1f} ms, "
              f"{rate[feed]:8.0f} samples/s")
    print(f"  loader / memory throughput: eager {rate['loader'] / rate['memory']:.3f}, graph "
          f"{rate['graph loader'] / rate['graph memory']:.3f} (goal >= 0.95)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--hidden", default="256,1024", help="MLP widths, comma-separated")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prefetch", type=int, default=2)
    p.add_argument("--workers", type=int, default=None,
                   help="loading processes a rank (DataLoader(workers=)); 0: a thread; "
                        "default: the loader's (one process a rank where the platform forks)")
    p.add_argument("--backend", choices=("threads", "torch"), default="threads",
                   help="ranks as threads of this process, or as gloo processes (one GIL each)")
    p.add_argument("--consumer", action="store_true",
                   help="print the rank thread's CPU a batch taken, not the training rates")
    args = p.parse_args()
    args.shown_workers = sf.data.DataLoader(  # what the loader makes of --workers
        [0], 1, sf.placement("cpu", [0]), prefetch=args.prefetch, workers=args.workers).workers
    torch.set_num_threads(1)  # kernels on the rank threads: no intra-op pool on 2 cores
    ds = Digits()
    if args.consumer:
        costs = sf.launch(_consumer, args.ranks, args=(ds, args))
        print(f"digits, batch {args.batch}, {args.ranks} thread ranks, prefetch {args.prefetch}, "
              f"{args.shown_workers or 'no'} worker processes a rank: the rank thread's CPU a "
              "batch taken: " + ", ".join(f"{c:.0f} us" for c, _ in costs) + "; loading a batch "
              "(read, stack, cut; warm): " + ", ".join(f"{c:.0f} us" for _, c in costs))
        return
    for hidden in (int(h) for h in args.hidden.split(",")):
        times = sf.launch(_rank, args.ranks, backend=args.backend, args=(ds, args, hidden))[0]
        ranks = "thread ranks" if args.backend == "threads" else "gloo processes"
        print(f"digits: {len(ds)} samples, batch {args.batch}, {args.ranks} {ranks}, "
              f"MLP 64-{hidden}-{hidden}-10, prefetch {args.prefetch}, "
              f"{args.shown_workers or 'no'} worker processes a rank; "
              f"{len(times['loader'])} epochs each, alternated (medians)")
        _report(times)


if __name__ == "__main__":
    main()
