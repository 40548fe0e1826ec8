"""Least-squares fits of the cost model's parameters to measured times (calibration).

A sample is ``(kind, p, nbytes, seconds)``: ``kind`` (one with a linear form, `sbpflow.comm.kinds`)
run on ``p`` ranks about ``nbytes`` (`sbpflow.cost.formulas`). `fit_alpha_beta` fits one
``(alpha, beta)`` to samples of every kind of a link class; `fit_collective` fits one kind its
own ``(alpha, beta, overhead)``, with the algorithm variant and the upward bend past a knee that
fit best; `fit_copy` fits the strided-copy cost. Fits of collective times minimise *relative*
error (each equation divided by its measured time), so small messages weigh as much as large
ones; every parameter is constrained to be >= 0 (`_nnls`).
"""

from __future__ import annotations

import math
import statistics
from typing import Iterable, Sequence

import torch

from ..comm.kinds import LINEAR_KINDS, VARIANTS
from .formulas import CollectiveFit, CostError, latency_messages, volume

__all__ = ["fit_alpha_beta", "fit_collective", "fit_copy"]


def _rows(samples: Iterable[Sequence], algorithm: str = "") -> tuple[list, set]:
    """Checked samples as ``(m, v, seconds)`` rows (α count and per-rank bytes of ``algorithm``'s
    form), and the set of their kinds."""
    rows, kinds = [], set()
    for s in samples:
        try:
            kind, p, n, t = s
        except (TypeError, ValueError):
            raise CostError(f"a sample is (kind, p, nbytes, seconds), got {s!r}") from None
        if kind not in LINEAR_KINDS:
            raise CostError(f"cannot fit samples of kind {kind!r}; one of {LINEAR_KINDS}")
        if isinstance(p, bool) or not isinstance(p, int) or p < 2:
            raise CostError(f"sample {s!r}: group size must be an int >= 2")
        if not (n >= 0 and t > 0 and math.isfinite(t)):
            raise CostError(f"sample {s!r}: need nbytes >= 0 and a finite time > 0")
        kinds.add(kind)
        rows.append((latency_messages(kind, p, algorithm), volume(kind, n, p, algorithm),
                     float(t)))
    return rows, kinds


def fit_alpha_beta(samples: Iterable[Sequence]) -> tuple[float, float, list[float]]:
    """Fit ``seconds ≈ m(kind, p)·alpha + v(kind, p, nbytes)·beta`` to ``samples``
    ``(kind, p, nbytes, seconds)`` of any kinds with a linear form, ``m`` the kind's α count and
    ``v`` its per-rank bytes. Relative least squares (module doc), so alpha is determined by the
    small messages; alpha and beta >= 0. Returns ``(alpha, beta, residuals)`` with
    ``residuals[i] = seconds_i - predicted_i`` in seconds, in the order of ``samples``.
    Raises `CostError` if the samples cannot determine both (e.g. one size and one group size).
    """
    rows, _ = _rows(samples)
    if len(rows) < 2:
        raise CostError(f"fit_alpha_beta needs at least 2 samples, got {len(rows)}")
    a = torch.tensor([[m / t, v / t] for m, v, t in rows], dtype=torch.float64)
    y = torch.ones(len(rows), dtype=torch.float64)
    if torch.linalg.matrix_rank(a).item() < 2:
        raise CostError("the samples do not determine alpha and beta apart: use several message "
                        "sizes (and group sizes)")
    alpha, beta = torch.linalg.lstsq(a, y.unsqueeze(1)).solution.squeeze(1).tolist()
    if alpha < 0 or beta < 0:  # the constrained optimum lies on an axis: best single-term fit
        alpha, beta = _one_term(a, y)
    residuals = [t - (m * alpha + v * beta) for m, v, t in rows]
    return alpha, beta, residuals


def _one_term(a: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """The better of ``(c, 0)`` and ``(0, c)``, ``c >= 0``, for ``a·(alpha, beta) ≈ y``."""
    best = None
    for col in (0, 1):
        x = a[:, col]
        c = max(float((x @ y) / (x @ x)), 0.0) if float(x @ x) > 0 else 0.0
        err = float(((x * c - y) ** 2).sum())
        if best is None or err < best[0]:
            best = (err, col, c)
    _, col, c = best
    return (c, 0.0) if col == 0 else (0.0, c)


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
    variant of the kind in `sbpflow.comm.kinds`, tried only when the samples have two or
    more group sizes, which tell the volumes apart) with `_fit_one` (``overhead`` and ``bend``
    as there), and return the fit with the least relative squared error (the default formula
    on ties)."""
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
    """Fit ``seconds ≈ overhead + m(kind, p)·alpha + v(kind, p, nbytes)·beta`` (the form of
    variant ``algorithm``) to ``samples`` of one kind, and possibly a bend ``+ max(0, v -
    knee)·beta2`` (`_bend`). Relative least squares, all parameters >= 0.

    ``overhead=None`` fits it when the samples have at least two different alpha counts ``m``
    (else ``overhead`` and ``alpha`` are the same column and only ``alpha`` is fitted);
    ``True`` requires that, ``False`` fixes it at 0. ``bend=None`` looks for a bend except on
    p2p (a transfer prices its messages one by one, where a bend on the message size would not
    be the bend on the rank's traffic); ``False``: a straight line. Returns
    ``(CollectiveFit(alpha, beta, overhead, algorithm, beta2, knee), residuals)`` with
    residuals in seconds as in `fit_alpha_beta`. Raises `CostError` if the samples mix kinds or
    cannot determine the parameters (fewer samples than parameters, or one message size).
    """
    rows, kinds = _rows(samples, algorithm)
    if len(kinds) > 1:
        raise CostError(f"fit_collective fits one kind at a time, got {sorted(kinds)}")
    rows = [(1.0, m, v, t) for m, v, t in rows]
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
    best = (_squared_error(a, x, y), dict(zip(cols, x)), 0.0)
    if bend is None:
        bend = kinds != {"p2p"}
    if bend and len(rows) >= len(cols) + 2:
        best = _bend(a, y, rows, cols, best)
    _, vals, knee = best
    beta2 = vals.get(3, 0.0)
    fit = CollectiveFit(vals.get(1, 0.0), vals.get(2, 0.0), vals.get(0, 0.0), algorithm,
                        beta2, knee if beta2 else 0.0)
    residuals = [t - fit.time(m, v) for _, m, v, t in rows]
    return fit, residuals


def _bend(a: torch.Tensor, y: torch.Tensor, rows: list, cols: list, straight: tuple) -> tuple:
    """The best bent fit ``(error, {column: value}, knee)``, or ``straight`` (same form) when no
    bend earns its place.

    Knees: each sampled per-rank volume not below their median (below, latency dominates and a
    bend only fits noise) with at least two larger volumes sampled (a slope through one point
    would fit that point's noise exactly, and extrapolate it). A bend is kept only if the
    Bayesian information criterion prefers it, counting it as two parameters (slope and knee):
    its squared error must be below ``n ** (-2 / n)`` times the straight fit's, ``n`` samples
    (40 % less for 8 samples, 20 % for 30). Noise alone buys that for about one straight
    8-sample fit in ten (2 % noise); such a bend is slight and prices the sampled range as well
    as the straight line. Memory-bound large messages bend the line upward on CPUs (the four
    collective kinds on gloo and on threads, measured 2026-11-23: -20 % residuals at 1 MB and
    +20-40 % at 4 MB without a bend)."""
    best = straight
    volumes = sorted({r[2] for r in rows})
    middle = statistics.median(volumes)
    for knee in [v for v in volumes[1:-2] if v >= middle]:
        ab = torch.cat([a, torch.tensor([[max(0.0, r[2] - knee) / r[3]] for r in rows],
                                        dtype=torch.float64)], dim=1)
        xb = _nnls(ab, y)
        err = _squared_error(ab, xb, y)
        if xb[-1] > 0 and err < straight[0] * len(rows) ** (-2 / len(rows)) and err < best[0]:
            best = (err, dict(zip(cols + [3], xb)), knee)
    return best


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
