"""Calibration: time real collectives on the current world and fit alpha and beta to them.

    cluster, report = sf.cost.calibrate()        # on every rank (inside sf.launch or torchrun)
    print(report); cluster.save("cluster.json")

or from the command line, ``sbpflow calibrate -n 4 --backend torch --out cluster.json``.

What is measured: all-gather, reduce-scatter, all-reduce, all-to-all and p2p (float32) over each
message size in ``sizes`` (bytes of the whole tensor, as in `sbpflow.cost.collectives`) and each
group size in ``group_sizes`` (p2p: one exchange call in which every member sends a message of
``size / p`` bytes to each other member and receives one from each; the sample's ``nbytes`` is
the message. A one-way pattern, where one rank only receives, ranked the fidelity benchmark's
strategies worse: Kendall tau 0.81 against 0.88 for this one, mean of 4 and 7 runs). Groups of a size tile
the world the way a mesh dim does, and all of them run at once: *intra* groups are consecutive
ranks inside one node, *inter* groups take one rank from each of consecutive nodes (ranks
``i, i+d, i+2d, …`` with ``d`` devices a node).
Each configuration first runs ``warmup`` untimed rounds (which also create the backend's process
groups); a timed round is a world barrier, then ``inner`` back-to-back calls (so the skew of
leaving the barrier is amortised), timed and divided by ``inner``. Rounds go round-robin over
the configurations, so load from outside spreads over all of them instead of spoiling one. A
round's time is the slowest rank's, and a sample is the median over ``repeats`` rounds. Then,
per link class, `fit_alpha_beta` solves the least-squares problem of the alpha-beta formulas for
one (alpha, beta) of the link, and (``per_kind=True``) `fit_collective` fits each kind its own
``(alpha, beta, overhead)``: ``t = overhead + m(kind, p)·alpha + v(kind, p, n)·beta`` (the
overhead only when the samples have two or more group sizes, else it cannot be told apart from
alpha), bent upward past a knee ``+ max(0, v - knee)·beta2`` where the samples clearly say so
(messages beyond the caches; `fit_collective`). The cluster carries the per-kind fits
(`Cluster.kinds`); kinds not measured keep the link's (alpha, beta).

Local copies (``copy=True``): every rank at once cuts a ``(rows, 512)`` float32 tensor of each
size into 4 column blocks with ``.contiguous()`` (the copy boxing makes for a split along a
non-leading axis) and ``t = c + copy_beta·n`` is fitted (``c`` >= 0, the call overhead, is not
kept); ``Cluster.copy_beta`` is the result.

Boxing step overhead (``step=True``): every rank at once runs a local boxing step (a slice, no
communication) through the planner's cache and the executor; the median is
``Cluster.step_overhead``.

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
from typing import Callable, Iterable, Sequence

import torch

from ..boxing.executor import run_step
from ..boxing.planner import plan_layouts
from ..comm import current, launch
from ..placement import placement
from ..sbp import B as _B
from ..sbp import Split as _Split
from ..comm.kinds import ALGORITHMS, LINEAR_KINDS, MEASURED_KINDS, VARIANTS
from .cluster import Cluster, CollectiveFit, CostError, Link
from .formulas import collective_time, latency_messages, volume

_ALGOS = ("",) + ALGORITHMS  # algorithm names as numbers, to broadcast fits as floats

__all__ = ["calibrate", "fit_alpha_beta", "fit_collective", "fit_copy", "CalibrationReport",
           "Sample", "calibrate_command", "add_arguments", "main", "MEASURED_KINDS"]

COPY_COLUMNS = 512  # row length (floats) of the tensor the copy measurement cuts into 4 blocks
DEFAULT_SIZES = (4 << 10, 64 << 10, 512 << 10, 2 << 20)
_FITTABLE = LINEAR_KINDS


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
        if isinstance(p, bool) or not isinstance(p, int) or p < 2:
            raise CostError(f"sample {s!r}: group size must be an int >= 2")
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


def _squared_error(a: torch.Tensor, x: list[float], y: torch.Tensor) -> float:
    """``|a·x - y|²`` of a least-squares solution ``x``."""
    return float(((a @ torch.tensor(x, dtype=a.dtype) - y) ** 2).sum())


def _nnls(a: torch.Tensor, y: torch.Tensor) -> list[float]:
    """``argmin |a·x - y|`` subject to ``x >= 0`` for a handful of columns: the best
    unconstrained least-squares solution over every subset of columns that is feasible (the
    constrained optimum is the unconstrained optimum of its support, so this is exact)."""
    k = a.shape[1]
    best: tuple | None = None
    # subsets by size, so that a tie (within rounding) keeps the one with fewer parameters
    for mask in sorted(range(1, 1 << k), key=lambda m: (bin(m).count("1"), m)):
        cols = [j for j in range(k) if mask >> j & 1]
        sub = a[:, cols]
        if torch.linalg.matrix_rank(sub).item() < len(cols):
            continue
        x = torch.linalg.lstsq(sub, y.unsqueeze(1)).solution.squeeze(1)
        if (x < 0).any():
            continue
        err = float(((sub @ x - y) ** 2).sum())
        # fewer parameters win ties (within rounding): no spurious terms
        if best is None or err < best[0] * (1 - 1e-9) - 1e-15:
            full = [0.0] * k
            for j, v in zip(cols, x.tolist()):
                full[j] = v
            best = (err, full)
    return best[1] if best is not None else [0.0] * k


def fit_collective(samples: Iterable[Sequence], overhead: bool | None = None,
                   algorithms: Sequence[str] | None = None, bend: bool | None = None
                   ) -> tuple[CollectiveFit, list[float]]:
    """Fit the kind's formula and each of its variants in ``algorithms`` (default: every
    variant of the kind in `sbpflow.cost.collectives`, tried only when the samples have two or
    more group sizes, which tell the volumes apart) with `_fit_one` (``bend`` as there), and
    return the fit with the least relative squared error (the default formula on ties)."""
    samples = list(samples)
    best = _fit_one(samples, overhead, "", bend)
    kinds = {s[0] for s in samples if isinstance(s, (tuple, list)) and s}
    several_p = len({s[1] for s in samples}) > 1
    if algorithms is None:
        algorithms = [a for k, a in VARIANTS if k in kinds] if several_p else []
    err = sum((r / s[3]) ** 2 for s, r in zip(samples, best[1]))
    for algo in algorithms:
        try:
            cand = _fit_one(samples, overhead, algo, bend)
        except CostError:
            continue
        e = sum((r / s[3]) ** 2 for s, r in zip(samples, cand[1]))
        if e < err * (1 - 1e-9):
            best, err = cand, e
    return best


def _fit_one(samples: Iterable[Sequence], overhead: bool | None = None, algorithm: str = "",
             bend: bool | None = None) -> tuple[CollectiveFit, list[float]]:
    """Fit ``seconds ≈ overhead + m(kind, p)·alpha + v(kind, p, nbytes)·beta`` to ``samples``
    of one collective kind (``(kind, p, nbytes, seconds)`` as in `fit_alpha_beta`), and
    possibly a bend ``+ max(0, v - knee)·beta2``.

    Least squares on relative error, all parameters >= 0. ``overhead=None`` fits it when the
    samples have at least two different alpha counts ``m`` (else ``overhead`` and ``alpha`` are
    the same column and only ``alpha`` is fitted); ``True`` requires that, ``False`` fixes it at
    0. ``bend=None`` (the default) tries a knee at each sampled per-rank volume not below
    their median with at least two larger volumes sampled, and keeps the best bend only if the
    Bayesian information criterion prefers it, counting it as two parameters (slope and knee):
    its squared error must be below ``n ** (-2 / n)`` times the straight fit's,
    ``n = len(samples)`` (40 % less for 8 samples, 20 % for 30). Noise alone buys that for
    about one straight 8-sample fit in ten (2 % noise); such a bend is slight and prices the
    sampled range as well as the straight line. Memory-bound large messages bend the line
    upward on CPUs (the four collective kinds on gloo and on threads, measured 2026-11-23:
    -20 % residuals at 1 MB and +20-40 % at 4 MB without a bend). ``False``: a straight
    line (p2p's default: a transfer prices its messages one by one, where a bend on the
    message size would not be the bend on the rank's traffic). Returns
    ``(CollectiveFit(alpha, beta, overhead, algorithm, beta2, knee), residuals)`` with
    residuals in seconds as in `fit_alpha_beta`. Raises `CostError` if the samples mix kinds or
    cannot determine the parameters (fewer samples than parameters, or one message size).
    """
    rows, kinds = [], set()
    for s in samples:
        try:
            kind, p, n, t = s
        except (TypeError, ValueError):
            raise CostError(f"a sample is (kind, p, nbytes, seconds), got {s!r}") from None
        if kind not in _FITTABLE:
            raise CostError(f"cannot fit samples of kind {kind!r}; one of {_FITTABLE}")
        if isinstance(p, bool) or not isinstance(p, int) or p < 2:
            raise CostError(f"sample {s!r}: group size must be an int >= 2")
        if not (n >= 0 and t > 0 and math.isfinite(t)):
            raise CostError(f"sample {s!r}: need nbytes >= 0 and a finite time > 0")
        kinds.add(kind)
        rows.append((1.0, latency_messages(kind, p, algorithm), volume(kind, n, p, algorithm),
                     float(t)))
    if len(kinds) > 1:
        raise CostError(f"fit_collective fits one kind at a time, got {sorted(kinds)}")
    several_m = len({m for _, m, _, _ in rows}) > 1
    if overhead is None:
        overhead = several_m
    elif overhead and not several_m:
        raise CostError("fitting an overhead needs samples of at least two group sizes")
    cols = [0, 1, 2] if overhead else [1, 2]
    if len(rows) < len(cols):
        raise CostError(f"fit_collective needs at least {len(cols)} samples, got {len(rows)}")
    a = torch.tensor([[r[c] / r[3] for c in cols] for r in rows], dtype=torch.float64)
    if torch.linalg.matrix_rank(a).item() < len(cols):
        raise CostError("the samples do not determine the parameters apart: use several message "
                        "sizes (and group sizes)")
    y = torch.ones(len(rows), dtype=torch.float64)
    x = _nnls(a, y)
    straight = _squared_error(a, x, y)
    best = (straight, dict(zip(cols, x)), 0.0)
    if bend is None:
        bend = kinds != {"p2p"}
    # knees in the upper half of the volumes (below, latency dominates the samples and a bend
    # only fits noise), with two larger volumes past them (a slope through one point would
    # fit that point's noise exactly, and extrapolate it)
    volumes = sorted({r[2] for r in rows})
    middle = statistics.median(volumes)
    knees = [v for v in volumes[1:-2] if v >= middle]
    for knee in knees if bend and len(rows) >= len(cols) + 2 else ():
        ab = torch.cat([a, torch.tensor([[max(0.0, r[2] - knee) / r[3]] for r in rows],
                                        dtype=torch.float64)], dim=1)
        xb = _nnls(ab, y)
        err = _squared_error(ab, xb, y)
        if xb[-1] > 0 and err < straight * len(rows) ** (-2 / len(rows)) and err < best[0]:
            best = (err, dict(zip(cols + [3], xb)), knee)
    _, vals, knee = best
    beta2 = vals.get(3, 0.0)
    fit = CollectiveFit(vals.get(1, 0.0), vals.get(2, 0.0), vals.get(0, 0.0), algorithm,
                        beta2, knee if beta2 else 0.0)
    residuals = [t - fit.time(m, v) for _, m, v, t in rows]
    return fit, residuals


def fit_copy(samples: Iterable[Sequence]) -> tuple[float, float]:
    """Fit ``seconds ≈ c + nbytes·copy_beta`` (both >= 0) to ``(nbytes, seconds)`` samples by
    ordinary (absolute) least squares; returns ``(copy_beta, c)``. Needs two or more sizes.

    Absolute, not relative, error: small copies stay in cache and cost little either way,
    large ones are memory-bound and are where copies cost time, so the slope should follow them.
    """
    try:
        rows = [(float(n), float(t)) for n, t in samples]
    except (TypeError, ValueError):
        raise CostError(f"fit_copy: samples are (nbytes, seconds) pairs, got "
                        f"{list(samples)!r}") from None
    if len({n for n, _ in rows}) < 2 or any(not (t > 0 and math.isfinite(t)) for _, t in rows):
        raise CostError("fit_copy needs finite positive times at two or more sizes")
    a = torch.tensor([[1.0, n] for n, _ in rows], dtype=torch.float64)
    y = torch.tensor([t for _, t in rows], dtype=torch.float64)
    scale = torch.tensor([1.0 / max(abs(float(y.max())), 1e-30),
                          1.0 / max(n for n, _ in rows)], dtype=torch.float64)
    c, beta = _nnls(a * scale, y * scale[0])  # columns scaled to O(1) for the solver
    return beta * float(scale[1]) / float(scale[0]), c


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
    link class; ``kind_fits[link][kind]`` the per-kind fits (if any), `CollectiveFit` tuples;
    ``rms[link]`` / ``worst[link]`` the RMS / largest absolute relative residual of the model
    the cluster uses (per-kind where fitted); ``copy_beta`` the strided-copy cost fitted to
    ``copy_samples``."""

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
    kind_fits: dict = field(default_factory=dict)  # link -> kind -> CollectiveFit fields
    copy_samples: list = field(default_factory=list)  # (nbytes, seconds)
    copy_beta: float = 0.0
    step_overhead: float = 0.0  # median seconds of one local boxing step (all ranks at once)

    def to_dict(self) -> dict:
        return {"backend": self.backend, "world_size": self.world_size,
                "devices_per_node": self.devices_per_node, "repeats": self.repeats,
                "inner": self.inner,
                "fits": {k: {"alpha": a, "beta": b} for k, (a, b) in self.fits.items()},
                "rms_relative_residual": self.rms, "max_relative_residual": self.worst,
                "copied": self.copied, "seconds": self.seconds,
                "kind_fits": {lc: {k: CollectiveFit(*f)._asdict()
                                   for k, f in t.items()} for lc, t in self.kind_fits.items()},
                "copy_samples": [list(c) for c in self.copy_samples],
                "copy_beta": self.copy_beta, "step_overhead": self.step_overhead,
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
            for kind, f in self.kind_fits.get(link, {}).items():
                lines.append(f"  {kind:<15}{CollectiveFit(*f)}")
        if self.copy_samples:
            pts = ", ".join(f"{n >> 10} KiB {t * 1e6:.0f} us" for n, t in self.copy_samples)
            lines.append(f"strided copy: {self.copy_beta * 1e12:.4g} ps/B ({pts})")
        if self.step_overhead:
            lines.append(f"boxing step overhead: {self.step_overhead * 1e6:.3g} us")
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
    src, dst = (_B,), (_Split(0),)
    comm = current()

    def run():
        for st in plan_layouts(shape, x.dtype, pl, src, pl, dst).steps:
            run_step(st, x, comm)
    return run


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
              flops_per_device: float | None = None, per_kind: bool = True,
              copy: bool = True, step: bool | Callable[[], object] = True,
              algorithms: bool = False) -> tuple[Cluster, CalibrationReport]:
    """Measure collectives on the current world and fit a `Cluster` to them (see the module doc).

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
    if copy:  # no group: every rank copies at once (shared cores and memory are the point)
        configs += [("local", 1, "copy", size) for size in sizes]
    if step:
        configs.append(("local", 1, "step", 0))
    times = torch.zeros(len(configs), repeats, dtype=torch.float64)
    nbytes_of: list[int] = []
    world_group = tuple(range(world))
    runners = []
    for link, g, kind, size in configs:
        if kind == "copy":
            mine = (me,)
            run, n = _copier(size, device)
        elif kind == "step":
            mine = (me,)
            run, n = (step if callable(step) else _stepper(world, device)), 0
        else:
            mine = next((gr for gr in _groups(link, g, world, dpn) if me in gr), None)
            run, n = _runner(kind, g, size, mine or (me,), device)
        nbytes_of.append(n)
        runners.append(run if mine is not None else None)
    # Rounds go round-robin over the configurations (all warm-ups first), so that a burst of
    # load from outside hits one round of many configurations, which the median discards,
    # rather than every round of one.
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
    every = comm.all_gather(times, world_group, shapes=[tuple(times.shape)] * world,
                            count_as="calibrate")
    slowest = torch.stack(every).amax(0)  # [config, repeat]: the slowest rank of each run

    report = CalibrationReport(comm.backend, world, dpn, repeats, inner)
    for (link, g, kind, _), n, row in zip(configs, nbytes_of, slowest.tolist()):
        if kind == "copy":
            report.copy_samples.append((n, statistics.median(row)))
        elif kind == "step":
            report.step_overhead = statistics.median(row)
        else:
            report.samples.append(Sample(link, kind, g, n, statistics.median(row)))
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
    copy_beta = 0.0
    if report.copy_samples:
        try:
            copy_beta = fit_copy(report.copy_samples)[0]
        except CostError:
            copy_beta = 0.0
    if memory_per_device is None:
        memory_per_device = _default_memory(device_type, dpn)
    # Every rank fitted the same samples, but least squares run on different threads may round
    # differently: take rank 0's numbers so the ranks agree exactly (NaN: no per-kind fit).
    nan = float("nan")
    flat = [fits["intra"].alpha, fits["intra"].beta, fits["inter"].alpha, fits["inter"].beta,
            float(memory_per_device), copy_beta, report.step_overhead]
    for link in ("intra", "inter"):
        for kind in MEASURED_KINDS:
            f = kfits.get(link, {}).get(kind)
            flat += [f.alpha, f.beta, f.overhead, float(_ALGOS.index(f.algorithm)), f.beta2,
                     f.knee] if f is not None else [nan] * 6
    agreed = comm.broadcast(torch.tensor(flat, dtype=torch.float64), 0, world_group).tolist()
    fits = {"intra": Link(agreed[0], agreed[1]), "inter": Link(agreed[2], agreed[3])}
    memory_per_device, copy_beta, report.step_overhead = agreed[4], agreed[5], agreed[6]
    kfits, i = {}, 7
    for link in ("intra", "inter"):
        for kind in MEASURED_KINDS:
            if not math.isnan(agreed[i]):
                kfits.setdefault(link, {})[kind] = CollectiveFit(
                    *agreed[i:i + 3], _ALGOS[int(agreed[i + 3])], *agreed[i + 4:i + 6])
            i += 6
    for link in report.fits:
        report.fits[link] = (fits[link].alpha, fits[link].beta)
        report.kind_fits[link] = {k: tuple(f) for k, f in kfits.get(link, {}).items()}
    report.copy_beta = copy_beta
    cluster = Cluster(nodes=nodes, devices_per_node=dpn, intra=fits["intra"],
                      inter=fits["inter"], memory_per_device=memory_per_device,
                      flops_per_device=flops_per_device, name="calibrated", kinds=kfits,
                      copy_beta=copy_beta, step_overhead=report.step_overhead)
    for link in report.fits:  # residuals of the model the cluster prices with
        mine = [s for s in report.samples if s.link == link]
        for s in mine:
            s.predicted = collective_time(s.kind, s.nbytes, s.p, kfits.get(link, {}).get(
                s.kind, fits[link]))
        rel = [s.relative_residual for s in mine]
        report.rms[link] = math.sqrt(sum(r * r for r in rel) / len(rel))
        report.worst[link] = max(abs(r) for r in rel)
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
