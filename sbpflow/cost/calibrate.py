"""Calibration: time real collectives on the current world and fit alpha and beta to them.

    cluster, report = sf.cost.calibrate()        # on every rank (inside sf.launch or torchrun)
    print(report); cluster.save("cluster.json")

or from the command line, ``sbpflow calibrate -n 4 --backend torch --out cluster.json``.

What is measured: all-gather, reduce-scatter, all-reduce and all-to-all (float32) over each
message size in ``sizes`` (bytes of the whole tensor, as in `sbpflow.cost.collectives`) and each
group size in ``group_sizes``. Groups of a size tile the world the way a mesh dim does, and all
of them run at once: *intra* groups are consecutive ranks inside one node, *inter* groups take
one rank from each of consecutive nodes (ranks ``i, i+d, i+2d, …`` with ``d`` devices a node).
Each configuration first runs ``warmup`` untimed rounds (which also create the backend's process
groups); a timed round is a world barrier, then ``inner`` back-to-back calls (so the skew of
leaving the barrier is amortised), timed and divided by ``inner``. A round's time is the slowest
rank's, and a sample is the median over ``repeats`` rounds. Then, per link class,
`fit_alpha_beta` solves the least-squares problem of the alpha-beta formulas for (alpha, beta).

With one node only ``intra`` is measured and ``inter`` is set equal to it (and the converse with
one device a node); the report says so. The calibration's own traffic is counted in
``sf.comm.stats()`` like any other.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

from ..comm import current, launch
from .cluster import Cluster, CostError, Link
from .collectives import collective_time, latency_messages, volume

__all__ = ["calibrate", "fit_alpha_beta", "CalibrationReport", "Sample", "calibrate_command",
           "add_arguments", "main", "MEASURED_KINDS"]

MEASURED_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
DEFAULT_SIZES = (4 << 10, 64 << 10, 512 << 10, 2 << 20)
_FITTABLE = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "p2p")


# -- least squares --------------------------------------------------------------------------------
def fit_alpha_beta(samples: Iterable[Sequence]) -> tuple[float, float, list[float]]:
    """Fit ``seconds ≈ m(kind, p)·alpha + v(kind, p, nbytes)·beta`` to ``samples``.

    ``samples`` are ``(kind, p, nbytes, seconds)`` with kind one of all_gather, reduce_scatter,
    all_reduce, all_to_all, p2p, ``m`` its alpha count and ``v`` its per-rank bytes (the formulas
    of `sbpflow.cost.collectives`). Least squares on *relative* error (each equation divided by
    its measured time), so small messages weigh as much as large ones and alpha is determined;
    alpha and beta are constrained to be >= 0. Returns ``(alpha, beta, residuals)`` with
    ``residuals[i] = seconds_i - predicted_i`` in seconds, in the order of ``samples``.
    Raises `CostError` if the samples cannot determine both (e.g. one size and one group size).
    """
    rows = []
    for s in samples:
        try:
            kind, p, n, t = s
        except (TypeError, ValueError):
            raise CostError(f"a sample is (kind, p, nbytes, seconds), got {s!r}") from None
        if kind not in _FITTABLE:
            raise CostError(f"cannot fit samples of kind {kind!r}; one of {_FITTABLE}")
        if isinstance(p, bool) or not isinstance(p, int) or p < 2 or (kind == "p2p" and p != 2):
            raise CostError(f"sample {s!r}: group size must be an int >= 2 (2 for p2p)")
        if not (n >= 0 and t > 0 and math.isfinite(t)):
            raise CostError(f"sample {s!r}: need nbytes >= 0 and a finite time > 0")
        rows.append((latency_messages(kind, p), volume(kind, n, p), float(t)))
    if len(rows) < 2:
        raise CostError(f"fit_alpha_beta needs at least 2 samples, got {len(rows)}")
    a = torch.tensor([[m / t, v / t] for m, v, t in rows], dtype=torch.float64)
    y = torch.ones(len(rows), dtype=torch.float64)
    if torch.linalg.matrix_rank(a).item() < 2:
        raise CostError("the samples do not determine alpha and beta apart: use several message "
                        "sizes (and group sizes)")
    alpha, beta = torch.linalg.lstsq(a, y.unsqueeze(1)).solution.squeeze(1).tolist()
    if alpha < 0 or beta < 0:  # the constrained optimum lies on an axis: best single-term fit
        best = None
        for col in (0, 1):
            x = a[:, col]
            c = max(float((x @ y) / (x @ x)), 0.0) if float(x @ x) > 0 else 0.0
            err = float(((x * c - y) ** 2).sum())
            if best is None or err < best[0]:
                best = (err, col, c)
        _, col, c = best
        alpha, beta = (c, 0.0) if col == 0 else (0.0, c)
    residuals = [t - (m * alpha + v * beta) for m, v, t in rows]
    return alpha, beta, residuals


# -- the report -----------------------------------------------------------------------------------
@dataclass
class Sample:
    """One measured point: median seconds over repeats of the slowest rank."""

    link: str  # "intra" or "inter"
    kind: str
    p: int
    nbytes: int
    seconds: float
    predicted: float = 0.0

    @property
    def relative_residual(self) -> float:
        return (self.seconds - self.predicted) / self.seconds


@dataclass
class CalibrationReport:
    """What `calibrate` measured and fitted. ``fits[link] = (alpha, beta)`` for each measured
    link class; ``rms[link]`` / ``worst[link]`` the RMS / largest absolute relative residual."""

    backend: str
    world_size: int
    devices_per_node: int
    repeats: int
    inner: int = 1
    samples: list = field(default_factory=list)
    fits: dict = field(default_factory=dict)
    rms: dict = field(default_factory=dict)
    worst: dict = field(default_factory=dict)
    copied: dict = field(default_factory=dict)  # unmeasured link class -> the one it copies
    seconds: float = 0.0  # wall time of the calibration

    def to_dict(self) -> dict:
        return {"backend": self.backend, "world_size": self.world_size,
                "devices_per_node": self.devices_per_node, "repeats": self.repeats,
                "inner": self.inner,
                "fits": {k: {"alpha": a, "beta": b} for k, (a, b) in self.fits.items()},
                "rms_relative_residual": self.rms, "max_relative_residual": self.worst,
                "copied": self.copied, "seconds": self.seconds,
                "samples": [[s.link, s.kind, s.p, s.nbytes, s.seconds, s.predicted]
                            for s in self.samples]}

    def __str__(self) -> str:
        nodes = self.world_size // self.devices_per_node
        lines = [f"calibration on {self.world_size} {self.backend} rank(s) "
                 f"({nodes} node(s) x {self.devices_per_node}), median of {self.repeats} "
                 f"rounds x {self.inner} calls, {self.seconds:.1f} s",
                 f"{'link':<6}{'kind':<16}{'p':>3}{'bytes':>11}{'measured us':>14}"
                 f"{'fit us':>11}{'resid':>8}"]
        for s in self.samples:
            lines.append(f"{s.link:<6}{s.kind:<16}{s.p:>3}{s.nbytes:>11}{s.seconds * 1e6:>14.1f}"
                         f"{s.predicted * 1e6:>11.1f}{s.relative_residual:>+8.0%}")
        for link, (a, b) in self.fits.items():
            lines.append(f"{link}: {Link(a, b)}; relative residuals rms {self.rms[link]:.1%}, "
                         f"max {self.worst[link]:.1%}")
        for link, src in self.copied.items():
            lines.append(f"{link}: not measured (no such link in this world), copied from {src}")
        return "\n".join(lines)


# -- measuring ------------------------------------------------------------------------------------
def _groups(link: str, g: int, world: int, dpn: int) -> list[tuple[int, ...]]:
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
    """A no-argument function running ``kind`` once in ``group``, and the exact bytes of T."""
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
    raise CostError(f"calibrate cannot measure {kind!r}; one of {MEASURED_KINDS}")


def _default_memory(device_type: str, dpn: int) -> float:
    if device_type == "cuda" and torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(current().device("cuda")).total_memory)
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / dpn
    except (ValueError, OSError, AttributeError):
        return 80.0 * 2 ** 30


def calibrate(sizes: Sequence[int] = DEFAULT_SIZES, group_sizes: Sequence[int] | None = None,
              repeats: int = 5, kinds: Sequence[str] = MEASURED_KINDS,
              devices_per_node: int | None = None, warmup: int = 1, inner: int = 4,
              device_type: str = "cpu",
              memory_per_device: float | None = None,
              flops_per_device: float | None = None) -> tuple[Cluster, CalibrationReport]:
    """Measure collectives on the current world and fit a `Cluster` to them (see the module doc).

    Every rank of the world must call it with the same arguments; every rank gets the same
    ``(cluster, report)``. ``sizes``: bytes of the whole tensor; ``group_sizes``: default every
    power of two and the node / device counts up to the world (sizes that fit no link class are
    skipped); ``devices_per_node``: default ``LOCAL_WORLD_SIZE`` (torchrun) if it divides the
    world, else the whole world is one node. ``memory_per_device`` defaults to the device's
    memory (cuda) or this machine's RAM shared by the devices of a node (cpu). Time taken is
    about ``(warmup + repeats) · inner`` calls of each kind, size and group size.
    """
    t_start = time.perf_counter()
    comm = current()
    world, me = comm.world_size, comm.rank
    if world < 2:
        raise CostError("calibrate needs a world of at least 2 ranks: run it inside "
                        "sf.launch(fn, n) or torchrun, or use `sbpflow calibrate -n N`")
    if devices_per_node is None:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
        devices_per_node = local if local > 0 and world % local == 0 else world
    dpn = devices_per_node
    if isinstance(dpn, bool) or not isinstance(dpn, int) or dpn < 1 or world % dpn:
        raise CostError(f"devices_per_node={dpn!r} must be a positive divisor of the world "
                        f"size {world}")
    nodes = world // dpn
    for what, v in (("repeats", repeats), ("inner", inner)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise CostError(f"{what} must be a positive int, got {v!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise CostError(f"warmup must be an int >= 0, got {warmup!r}")
    bad = [k for k in kinds if k not in MEASURED_KINDS]
    if bad or not kinds:
        raise CostError(f"calibrate measures kinds among {MEASURED_KINDS}, got {list(kinds)}")
    sizes = sorted({int(s) for s in sizes})
    if len(sizes) < 2 or sizes[0] <= 0:
        raise CostError(f"calibrate needs at least 2 distinct positive message sizes, got {sizes}")
    if group_sizes is None:
        top = max(dpn, nodes)
        group_sizes = {2 ** k for k in range(1, top.bit_length()) if 2 ** k <= top} | {dpn, nodes}
    group_sizes = sorted({int(g) for g in group_sizes if int(g) >= 2})
    classes = {"intra": [g for g in group_sizes if g <= dpn],
               "inter": [g for g in group_sizes if g <= nodes]}
    classes = {k: v for k, v in classes.items() if v}
    if not classes:
        raise CostError(f"no group size in {group_sizes} fits the world ({nodes} node(s) x {dpn})")
    device = comm.device(device_type)

    configs = [(link, g, kind, size) for link, gs in classes.items() for g in gs
               for kind in kinds for size in sizes]
    times = torch.zeros(len(configs), repeats, dtype=torch.float64)
    nbytes_of: list[int] = []
    world_group = tuple(range(world))
    for c, (link, g, kind, size) in enumerate(configs):
        mine = next((gr for gr in _groups(link, g, world, dpn) if me in gr), None)
        run, n = _runner(kind, g, size, mine or (me,), device)
        nbytes_of.append(n)
        for rep in range(warmup + repeats):
            comm.barrier(world_group)
            t0 = time.perf_counter()
            if mine is not None:
                for _ in range(inner):
                    run()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
            dt = (time.perf_counter() - t0) / inner
            if rep >= warmup and mine is not None:
                times[c, rep - warmup] = dt
    every = comm.all_gather(times, world_group, shapes=[tuple(times.shape)] * world,
                            count_as="calibrate")
    slowest = torch.stack(every).amax(0)  # [config, repeat]: the slowest rank of each run

    report = CalibrationReport(comm.backend, world, dpn, repeats, inner)
    for (link, g, kind, _), n, row in zip(configs, nbytes_of, slowest.tolist()):
        report.samples.append(Sample(link, kind, g, n, statistics.median(row)))
    fits: dict[str, Link] = {}
    for link in classes:
        mine = [s for s in report.samples if s.link == link]
        alpha, beta, _ = fit_alpha_beta([(s.kind, s.p, s.nbytes, s.seconds) for s in mine])
        fits[link] = Link(alpha, beta)
        for s in mine:
            s.predicted = collective_time(s.kind, s.nbytes, s.p, fits[link])
        rel = [s.relative_residual for s in mine]
        report.fits[link] = (alpha, beta)
        report.rms[link] = math.sqrt(sum(r * r for r in rel) / len(rel))
        report.worst[link] = max(abs(r) for r in rel)
    for link, other in (("intra", "inter"), ("inter", "intra")):
        if link not in fits:
            fits[link] = fits[other]
            report.copied[link] = other
    if memory_per_device is None:
        memory_per_device = _default_memory(device_type, dpn)
    # Every rank fitted the same samples, but least squares run on different threads may round
    # differently: take rank 0's numbers so the ranks agree exactly.
    agreed = comm.broadcast(torch.tensor([fits["intra"].alpha, fits["intra"].beta,
                                          fits["inter"].alpha, fits["inter"].beta,
                                          float(memory_per_device)], dtype=torch.float64),
                            0, world_group).tolist()
    fits = {"intra": Link(agreed[0], agreed[1]), "inter": Link(agreed[2], agreed[3])}
    memory_per_device = agreed[4]
    for link in report.fits:
        report.fits[link] = (fits[link].alpha, fits[link].beta)
    cluster = Cluster(nodes=nodes, devices_per_node=dpn, intra=fits["intra"],
                      inter=fits["inter"], memory_per_device=memory_per_device,
                      flops_per_device=flops_per_device, name="calibrated")
    report.seconds = time.perf_counter() - t_start
    return cluster, report


# -- command line ---------------------------------------------------------------------------------
def add_arguments(parser) -> None:
    """Arguments of ``sbpflow calibrate`` on an argparse parser."""
    parser.add_argument("-n", "--nproc", type=int, default=4,
                        help="number of ranks to launch (default 4; ignored under torchrun)")
    parser.add_argument("--backend", choices=["threads", "torch"], default="threads",
                        help="threads: one thread a rank in this process; torch: gloo processes")
    parser.add_argument("--out", default="cluster.json",
                        help="cluster file to write (default cluster.json)")
    parser.add_argument("--devices-per-node", type=int, default=None,
                        help="devices a node (default: LOCAL_WORLD_SIZE under torchrun, else all)")
    parser.add_argument("--sizes", type=lambda s: [int(float(v)) for v in s.split(",")],
                        default=list(DEFAULT_SIZES),
                        help="message sizes in bytes, comma-separated (default "
                             + ",".join(map(str, DEFAULT_SIZES)) + ")")
    parser.add_argument("--group-sizes", type=lambda s: [int(v) for v in s.split(",")],
                        default=None, help="group sizes, comma-separated (default powers of 2)")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds a sample (median)")
    parser.add_argument("--inner", type=int, default=4, help="back-to-back calls a timed round")


def _calibrate_rank(kwargs: dict) -> tuple[Cluster, CalibrationReport]:
    """What each launched rank runs (module-level so gloo processes can import it)."""
    return calibrate(**kwargs)


def calibrate_command(args) -> int:
    """``sbpflow calibrate``: launch ``args.nproc`` ranks on ``args.backend`` (or, under
    torchrun, use the world already there), calibrate, print the report and write the cluster
    file ``args.out`` (with the report stored alongside). Returns the exit code."""
    kwargs = dict(sizes=getattr(args, "sizes", None) or DEFAULT_SIZES,
                  group_sizes=getattr(args, "group_sizes", None),
                  repeats=getattr(args, "repeats", 5) or 5, inner=getattr(args, "inner", 4) or 4,
                  devices_per_node=getattr(args, "devices_per_node", None))
    out = getattr(args, "out", "cluster.json")
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:  # torchrun: this process is a rank
        from ..comm import init
        comm = init()
        cluster, report = calibrate(**kwargs)
        if comm.rank != 0:
            return 0
    else:
        n = getattr(args, "nproc", None) or getattr(args, "n", None) or 4
        cluster, report = launch(_calibrate_rank, n, backend=getattr(args, "backend", "threads"),
                                 args=(kwargs,))[0]
    print(report)
    print(cluster)
    if out:
        cluster.save(out, extra=report.to_dict())
        print(f"saved {out}")
    sys.stdout.flush()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``sbpflow calibrate`` as a function (until the CLI wires it): ``main(["-n", "4"])``."""
    import argparse
    parser = argparse.ArgumentParser(prog="sbpflow calibrate", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return calibrate_command(parser.parse_args(argv))
