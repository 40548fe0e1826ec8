"""Timing collectives, local copies and a boxing step on the current world, for calibration.

A configuration (`Config`) is a collective kind run in groups of ``p`` ranks of a link class that
tile the world as a mesh dim does, all groups at once (*intra*: consecutive ranks inside one
node; *inter*: one rank from each of ``p`` consecutive nodes), or a local copy / boxing step
that every rank runs at once. Each configuration first runs ``warmup`` untimed rounds (which
also create the backend's process groups); a timed round is a world barrier, then ``inner``
back-to-back calls (amortising the skew of leaving the barrier), divided by ``inner``. Rounds
go round-robin over the configurations, so load from outside spreads over all of them instead
of spoiling one. A round's time is the slowest rank's; a sample is the median over ``repeats``
rounds.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import NamedTuple, Sequence

import torch

from ..boxing.executor import run_step
from ..boxing.planner import plan_layouts
from ..comm import current
from ..comm.kinds import MEASURED_KINDS
from ..layouts import Layout
from ..placement import placement
from ..sbp import B, Split
from .formulas import CostError

__all__ = ["Config", "configurations", "measure", "link_groups", "default_memory",
           "COPY_COLUMNS"]

COPY_COLUMNS = 512  # row length (floats) of the tensor the copy measurement cuts into 4 blocks


class Config(NamedTuple):
    """One thing to time: ``kind`` (a measured collective kind, ``"copy"`` or ``"step"``) in
    groups of ``p`` ranks of link class ``link`` (``"local"``: every rank alone) about ``size``
    requested bytes."""

    link: str
    p: int
    kind: str
    size: int


def configurations(classes: dict, kinds: Sequence[str], sizes: Sequence[int], copy: bool,
                   step: object) -> list[Config]:
    """Every configuration to time: each link class's group sizes (``classes[link]``) x kinds
    x sizes, then the local copies of each size (``copy``) and the boxing step (``step``)."""
    configs = [Config(link, g, kind, size) for link, gs in classes.items() for g in gs
               for kind in kinds for size in sizes]
    if copy:  # no group: every rank copies at once (shared cores and memory are the point)
        configs += [Config("local", 1, "copy", size) for size in sizes]
    if step:
        configs.append(Config("local", 1, "step", 0))
    return configs


def measure(configs: Sequence[Config], dpn: int, device: torch.device, step: object,
            warmup: int, repeats: int, inner: int) -> list[tuple[Config, int, float]]:
    """Time ``configs`` on the current world (module doc): ``(config, exact bytes, median
    seconds of the slowest rank)`` each. ``step``: a no-argument callable timed as the boxing
    step, or anything true for the default (`_stepper`). Every rank calls it alike."""
    comm = current()
    world = comm.world_size
    runners, nbytes_of = [], []
    for c in configs:
        run, n = _runner_of(c, world, dpn, device, step)
        runners.append(run)
        nbytes_of.append(n)
    times = _rounds(runners, warmup, repeats, inner, device)
    world_group = tuple(range(world))
    every = comm.all_gather(times, world_group, shapes=[tuple(times.shape)] * world,
                            count_as="calibrate")
    slowest = torch.stack(every).amax(0)  # [config, repeat]: the slowest rank of each run
    return [(c, n, statistics.median(row))
            for c, n, row in zip(configs, nbytes_of, slowest.tolist())]


def _runner_of(c: Config, world: int, dpn: int, device: torch.device, step: object):
    """This rank's no-argument function for ``c`` (None: the rank is in no group of it) and the
    exact bytes it is about."""
    me = current().rank
    if c.kind == "copy":
        return _copier(c.size, device)
    if c.kind == "step":
        return (step if callable(step) else _stepper(world, device)), 0
    mine = next((gr for gr in link_groups(c.link, c.p, world, dpn) if me in gr), None)
    run, n = _runner(c.kind, c.p, c.size, mine or (me,), device)
    return (run if mine is not None else None), n


def _rounds(runners: list, warmup: int, repeats: int, inner: int,
            device: torch.device) -> torch.Tensor:
    """This rank's seconds a call, ``[config, repeat]``: ``warmup`` untimed rounds, then
    ``repeats`` timed ones, each round over every configuration in turn (a burst of load from
    outside hits one round of many configurations, which the median discards, rather than every
    round of one)."""
    comm = current()
    world_group = tuple(range(comm.world_size))
    times = torch.zeros(len(runners), repeats, dtype=torch.float64)
    for rep in range(warmup + repeats):
        for c, run in enumerate(runners):
            comm.barrier(world_group)
            t0 = time.perf_counter()
            if run is not None:
                for _ in range(inner):
                    run()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
            dt = (time.perf_counter() - t0) / inner
            if rep >= warmup and run is not None:
                times[c, rep - warmup] = dt
    return times


def link_groups(link: str, g: int, world: int, dpn: int) -> list[tuple[int, ...]]:
    """Disjoint groups of ``g`` ranks of link class ``link``, tiling the world."""
    nodes = world // dpn
    out = []
    if link == "intra":
        for node in range(nodes):
            for k in range(dpn // g):
                out.append(tuple(node * dpn + k * g + j for j in range(g)))
    else:
        for i in range(dpn):
            for k in range(nodes // g):
                out.append(tuple((k * g + j) * dpn + i for j in range(g)))
    return out


def _runner(kind: str, g: int, nbytes: int, group: tuple, device: torch.device):
    """A no-argument function running ``kind`` once in ``group``, and the exact bytes it is
    about (`sbpflow.comm.kinds`; float32). p2p is one exchange call in which every member sends
    a message of ``nbytes / p`` bytes to each other member and receives one from each; its
    bytes are the message (a one-way pattern, where one rank only receives, ranked the fidelity
    benchmark's strategies worse: Kendall tau 0.81 against 0.88 for this one, mean of 4 and 7
    runs)."""
    comm = current()
    piece = max(1, round(nbytes / (4 * g)))
    n = piece * g * 4
    if kind == "all_gather":
        x = torch.randn(piece, device=device)
        shapes = [(piece,)] * g
        # assemble with a real copy, as boxing does (the threads backend otherwise moves
        # nothing: pieces are shared by reference)
        return (lambda: comm.all_gather(x, group, shapes=shapes, assemble=torch.cat)), n
    if kind == "reduce_scatter":
        pieces = list(torch.randn(g, piece, device=device).unbind(0))
        return (lambda: comm.reduce_scatter(pieces, group)), n
    if kind == "all_reduce":
        x = torch.randn(piece * g, device=device)
        return (lambda: comm.all_reduce(x, group)), n
    if kind == "all_to_all":
        pieces = list(torch.randn(g, piece, device=device).unbind(0))
        shapes = [(piece,)] * g
        return (lambda: comm.all_to_all(pieces, group, shapes=shapes, assemble=torch.cat)), n
    if kind == "p2p":
        # one exchange call: a message of `piece` floats to and from every other member
        x = torch.randn(piece, device=device)
        others = [r for r in group if r != comm.rank]
        recv = [(r, (piece,), x.dtype, device) for r in others]
        return (lambda: comm.exchange([(r, x) for r in others], recv)), piece * 4
    raise CostError(f"calibrate cannot measure {kind!r}; one of {MEASURED_KINDS}")


def _copier(nbytes: int, device: torch.device):
    """A no-argument function cutting a ``(rows, COPY_COLUMNS)`` float32 tensor of about
    ``nbytes`` into 4 column blocks with ``.contiguous()``, and the exact bytes copied."""
    rows = max(1, round(nbytes / (4 * COPY_COLUMNS)))
    x = torch.randn(rows, COPY_COLUMNS, device=device)
    w = COPY_COLUMNS // 4
    return (lambda: [x[:, j * w:(j + 1) * w].contiguous() for j in range(4)]), \
        rows * COPY_COLUMNS * 4


def _stepper(world: int, device: torch.device):
    """A no-argument function running one local boxing step (``B -> S(0)`` of a small tensor
    over the world: a slice, no communication) the way ``to_global`` does: the cached plan
    lookup, then the executor."""
    pl = placement(device.type, ranks=list(range(world)))
    shape = (world * 4, 4)
    x = torch.randn(*shape, device=device)
    src, dst = Layout.parsed(pl, (B,)), Layout.parsed(pl, (Split(0),))
    comm = current()

    def run():
        for st in plan_layouts(shape, x.dtype, src, dst).steps:
            run_step(st, x, comm)
    return run


def default_memory(device_type: str, dpn: int) -> float:
    """A device's memory (cuda), or this machine's RAM shared by the ``dpn`` devices of a node."""
    if device_type == "cuda" and torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(current().device("cuda")).total_memory)
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / dpn
    except (ValueError, OSError, AttributeError):
        return 80.0 * 2 ** 30
