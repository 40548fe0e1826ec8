"""Calibration: measure the current world and fit the cost model to it.

    cluster, report = sf.cost.calibrate()        # on every rank (inside sf.launch or torchrun)
    print(report); cluster.save("cluster.json")

or from the command line, ``sbpflow calibrate -n 4 --backend torch --out cluster.json``.
`calibrate` times the measured collective kinds, local strided copies and a boxing step
(`sbpflow.cost.measure`), fits per link class one ``(alpha, beta)`` and per kind its own
``(alpha, beta, overhead)``, bent where the samples say so (`sbpflow.cost.fit`), and returns the
`Cluster` with the `CalibrationReport` (`sbpflow.cost.report`). Kinds not measured keep the
link's (alpha, beta); with one node only ``intra`` is measured and ``inter`` copies it (and the
converse with one device a node). The calibration's own traffic is counted in
``sf.comm.stats()`` like any other.
"""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Callable, Sequence

import torch

from ..comm import current, launch
from ..comm.kinds import ALGORITHMS, MEASURED_KINDS
from .cluster import Cluster
from .fit import fit_alpha_beta, fit_collective, fit_copy
from .formulas import CollectiveFit, CostError, Link, collective_time
from .measure import configurations, default_memory, measure
from .report import CalibrationReport, Sample

__all__ = ["calibrate", "fit_alpha_beta", "fit_collective", "fit_copy", "CalibrationReport",
           "Sample", "calibrate_command", "add_arguments", "main", "MEASURED_KINDS"]

DEFAULT_SIZES = (4 << 10, 64 << 10, 512 << 10, 2 << 20)
_ALGOS = ("",) + ALGORITHMS  # algorithm names as numbers, to broadcast fits as floats


def calibrate(sizes: Sequence[int] = DEFAULT_SIZES, group_sizes: Sequence[int] | None = None,
              repeats: int = 5, kinds: Sequence[str] = MEASURED_KINDS,
              devices_per_node: int | None = None, warmup: int = 1, inner: int = 4,
              device_type: str = "cpu",
              memory_per_device: float | None = None,
              flops_per_device: float | None = None, per_kind: bool = True,
              copy: bool = True, step: bool | Callable[[], object] = True,
              algorithms: bool = False) -> tuple[Cluster, CalibrationReport]:
    """Measure the current world and fit a `Cluster` to it (module doc; how it times:
    `sbpflow.cost.measure`, how it fits: `sbpflow.cost.fit`).

    Every rank of the world must call it with the same arguments; every rank gets the same
    ``(cluster, report)``. ``sizes``: bytes of the whole tensor; ``group_sizes``: default every
    power of two and the node / device counts up to the world (sizes that fit no link class are
    skipped); ``devices_per_node``: default ``LOCAL_WORLD_SIZE`` (torchrun) if it divides the
    world, else the whole world is one node. ``memory_per_device`` defaults to the device's
    memory (cuda) or this machine's RAM shared by the devices of a node (cpu). ``per_kind``:
    also fit every measured kind its own (alpha, beta, overhead) (`Cluster.kinds`); ``copy``:
    also measure the strided-copy cost (`Cluster.copy_beta`); ``step``: also measure the
    software cost of one boxing step (`Cluster.step_overhead`), by default as a local step run
    through the planner's cache and the executor; a no-argument callable instead is timed as
    that step (e.g. a communication-free ``to_global`` from the layers above, which adds the
    cost of the tensor API; this layer cannot import them); ``algorithms``: let the
    per-kind fits also try the kinds' algorithm variants (direct all-reduce) and keep the one
    that fits better (off by default: on the fidelity benchmark's threads runs the better
    calibration fit did not predict better). Time taken is about
    ``(warmup + repeats) · inner`` calls of each kind, size and group size.
    """
    t_start = time.perf_counter()
    comm = current()
    dpn, sizes, classes = _setup(comm.world_size, sizes, group_sizes, repeats, kinds,
                                 devices_per_node, warmup, inner)
    configs = configurations(classes, kinds, sizes, copy, step)
    measured = measure(configs, dpn, comm.device(device_type), step, warmup, repeats, inner)
    report = _report(measured, CalibrationReport(comm.backend, comm.world_size, dpn, repeats,
                                                 inner))
    fits, kfits = _fit_links(report, classes, kinds, per_kind, algorithms)
    copy_beta = _copy_beta(report.copy_samples)
    if memory_per_device is None:
        memory_per_device = default_memory(device_type, dpn)
    fits, kfits, memory_per_device, copy_beta, report.step_overhead = _agree(
        fits, kfits, [memory_per_device, copy_beta, report.step_overhead])
    for link in report.fits:
        report.fits[link] = (fits[link].alpha, fits[link].beta)
        report.kind_fits[link] = {k: tuple(f) for k, f in kfits.get(link, {}).items()}
    report.copy_beta = copy_beta
    cluster = Cluster(nodes=comm.world_size // dpn, devices_per_node=dpn, intra=fits["intra"],
                      inter=fits["inter"], memory_per_device=memory_per_device,
                      flops_per_device=flops_per_device, name="calibrated", kinds=kfits,
                      copy_beta=copy_beta, step_overhead=report.step_overhead)
    _residuals(report, fits, kfits)
    report.seconds = time.perf_counter() - t_start
    return cluster, report


def _report(measured: list, report: CalibrationReport) -> CalibrationReport:
    """``report`` with the ``(config, bytes, seconds)`` of `measure` filed: collective samples,
    strided-copy samples and the boxing step's software cost."""
    for c, n, seconds in measured:
        if c.kind == "copy":
            report.copy_samples.append((n, seconds))
        elif c.kind == "step":
            report.step_overhead = seconds
        else:
            report.samples.append(Sample(c.link, c.kind, c.p, n, seconds))
    return report


def _copy_beta(copy_samples: list) -> float:
    """Seconds per byte of a strided copy fitted to ``copy_samples`` (0 with none, or when
    they do not fit)."""
    if not copy_samples:
        return 0.0
    try:
        return fit_copy(copy_samples)[0]
    except CostError:
        return 0.0


def _setup(world: int, sizes, group_sizes, repeats, kinds, dpn, warmup,
           inner) -> tuple[int, list[int], dict]:
    """Check `calibrate`'s arguments; ``(devices per node, sorted sizes, {link class: group
    sizes})`` with the defaults of its docstring filled in."""
    if world < 2:
        raise CostError("calibrate needs a world of at least 2 ranks: run it inside "
                        "sf.launch(fn, n) or torchrun, or use `sbpflow calibrate -n N`")
    if dpn is None:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
        dpn = local if local > 0 and world % local == 0 else world
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
    return dpn, sizes, classes


def _fit_links(report: CalibrationReport, classes: dict, kinds: Sequence[str], per_kind: bool,
               algorithms: bool) -> tuple[dict, dict]:
    """Per link class, the `Link` fitted to all its samples and (``per_kind``) each kind's
    `CollectiveFit` (a kind with too few points keeps the link's); a link class not measured
    copies the other's, as ``report.copied`` records. Fills ``report.fits``."""
    fits: dict[str, Link] = {}
    kfits: dict[str, dict[str, CollectiveFit]] = {}
    for link in classes:
        mine = [s for s in report.samples if s.link == link]
        alpha, beta, _ = fit_alpha_beta([(s.kind, s.p, s.nbytes, s.seconds) for s in mine])
        fits[link] = Link(alpha, beta)
        report.fits[link] = (alpha, beta)
        if per_kind:
            for kind in kinds:
                ks = [(s.kind, s.p, s.nbytes, s.seconds) for s in mine if s.kind == kind]
                try:
                    kfits.setdefault(link, {})[kind] = fit_collective(
                        ks, algorithms=None if algorithms else ())[0]
                except CostError:  # too few points for this kind: it keeps the link's fit
                    pass
    for link, other in (("intra", "inter"), ("inter", "intra")):
        if link not in fits:
            fits[link] = fits[other]
            if other in kfits:
                kfits[link] = dict(kfits[other])
            report.copied[link] = other
    return fits, kfits


def _agree(fits: dict, kfits: dict, extra: list[float]) -> tuple:
    """Rank 0's ``(fits, kfits, *extra)``, on every rank. Every rank fitted the same samples,
    but least squares run on different threads may round differently; the ranks must agree
    exactly. Sent as one float64 broadcast (NaN: no per-kind fit)."""
    nan = float("nan")
    flat = [fits["intra"].alpha, fits["intra"].beta, fits["inter"].alpha, fits["inter"].beta]
    flat += [float(v) for v in extra]
    for link in ("intra", "inter"):
        for kind in MEASURED_KINDS:
            f = kfits.get(link, {}).get(kind)
            flat += [f.alpha, f.beta, f.overhead, float(_ALGOS.index(f.algorithm)), f.beta2,
                     f.knee] if f is not None else [nan] * 6
    comm = current()
    agreed = comm.broadcast(torch.tensor(flat, dtype=torch.float64), 0,
                            tuple(range(comm.world_size))).tolist()
    fits = {"intra": Link(agreed[0], agreed[1]), "inter": Link(agreed[2], agreed[3])}
    i = 4 + len(extra)
    kfits = {}
    for link in ("intra", "inter"):
        for kind in MEASURED_KINDS:
            if not math.isnan(agreed[i]):
                kfits.setdefault(link, {})[kind] = CollectiveFit(
                    *agreed[i:i + 3], _ALGOS[int(agreed[i + 3])], *agreed[i + 4:i + 6])
            i += 6
    return (fits, kfits, *agreed[4:4 + len(extra)])


def _residuals(report: CalibrationReport, fits: dict, kfits: dict) -> None:
    """Each sample's prediction by the model the cluster prices with (per-kind fit where there
    is one), and per measured link class the RMS / largest relative residual."""
    for link in report.fits:
        mine = [s for s in report.samples if s.link == link]
        for s in mine:
            s.predicted = collective_time(s.kind, s.nbytes, s.p, kfits.get(link, {}).get(
                s.kind, fits[link]))
        rel = [s.relative_residual for s in mine]
        report.rms[link] = math.sqrt(sum(r * r for r in rel) / len(rel))
        report.worst[link] = max(abs(r) for r in rel)


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
