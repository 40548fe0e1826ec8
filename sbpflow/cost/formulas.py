"""Alpha-beta times of one collective: the formulas of the kinds of `sbpflow.comm.kinds`.

For a group of ``p`` ranks on a link ``(α, β)`` and ``n`` bytes (what ``n`` is per kind:
`sbpflow.comm.kinds`), a linear kind takes ``m(p)·α + v(p)·n·β`` (its `Form`: all_gather,
reduce_scatter, all_to_all ``(p-1)·α + (p-1)/p·n·β``; all_reduce ``2(p-1)·α + 2(p-1)/p·n·β``;
p2p, one exchange call in which each rank sends a message of ``n`` bytes to each of the ``p-1``
others, ``(p-1)·(α + n·β)``). Broadcast (``L = ⌈log2 p⌉``) is the faster of a binomial tree,
``L·(α + n·β)``, and van de Geijn's scatter + ring all-gather, ``(L+p-1)·α + 2(p-1)/p·n·β``, as
MPI libraries switch between. A one-rank group costs 0. A `CollectiveFit` ``(α, β, o)`` adds its
per-call overhead ``o`` once, may name an algorithm variant whose form replaces the kind's
(``direct`` all-reduce: ``(p-1)·α + (p-1)·n·β``), and may bend past a knee
(`CollectiveFit.time`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from ..comm.kinds import ALGORITHMS, KINDS, LINEAR_KINDS, TABLE, VARIANTS, Form
from ..errors import CostError

__all__ = ["CostError", "Link", "CollectiveFit", "KINDS", "ALGORITHMS", "collective_time",
           "latency_messages", "volume", "form", "LinearTime", "linear_time"]


class Link(NamedTuple):
    """Latency ``alpha`` (s per message) and inverse bandwidth ``beta`` (s per byte)."""

    alpha: float
    beta: float

    @property
    def bandwidth(self) -> float:
        """Bytes per second (``1 / beta``; inf for a free link)."""
        return math.inf if self.beta == 0 else 1.0 / self.beta

    def time(self, nbytes: float, messages: float = 1) -> float:
        """Seconds for ``messages`` messages carrying ``nbytes`` bytes in total."""
        return messages * self.alpha + nbytes * self.beta

    def __str__(self) -> str:
        return f"alpha {self.alpha * 1e6:.3g} us, beta {self.beta * 1e12:.4g} ps/B " \
               f"({self.bandwidth / 1e9:.4g} GB/s)"


def _seconds(fixed: float, v: float, beta: float, knee: float, beta2: float) -> float:
    """``fixed + v·beta + max(0, v - knee)·beta2``: a call's seconds once its fixed part
    (overhead + m·alpha) and its per-rank bytes ``v`` are known (`CollectiveFit.time`,
    `LinearTime.time`)."""
    t = fixed + v * beta
    if beta2 and v > knee:
        t += (v - knee) * beta2
    return t


class CollectiveFit(NamedTuple):
    """Parameters of one collective kind on one link class: ``overhead + m·alpha + v·beta +
    max(0, v - knee)·beta2`` seconds for a call with alpha count ``m`` and per-rank bytes ``v``
    (a one-rank group: 0). ``algorithm`` names the variant whose ``m`` and ``v`` apply
    (`sbpflow.comm.kinds`; ``""``: the kind's default, e.g. the ring all-reduce).
    ``beta2`` (default 0: none) is the extra cost per byte past ``knee`` bytes a rank: messages
    larger than the caches move at memory speed, which calibration sees as a bend upward."""

    alpha: float
    beta: float
    overhead: float = 0.0
    algorithm: str = ""
    beta2: float = 0.0
    knee: float = 0.0

    def time(self, messages: float, nbytes: float) -> float:
        """Seconds for a call with ``messages`` alpha terms and ``nbytes`` per-rank bytes."""
        return _seconds(self.overhead + messages * self.alpha, nbytes, self.beta, self.knee,
                        self.beta2)

    def __str__(self) -> str:
        algo = f" ({self.algorithm})" if self.algorithm else ""
        bend = f", +{self.beta2 * 1e12:.4g} ps/B past {self.knee / 1024:.4g} KiB" \
            if self.beta2 else ""
        return f"overhead {self.overhead * 1e6:.3g} us, alpha {self.alpha * 1e6:.3g} us, " \
               f"beta {self.beta * 1e12:.4g} ps/B{bend}{algo}"


def _check(kind: str, nbytes: float, p: int) -> None:
    if kind not in KINDS:
        raise CostError(f"unknown collective kind {kind!r}; one of {KINDS}")
    if not (isinstance(nbytes, (int, float)) and nbytes >= 0):
        raise CostError(f"{kind}: nbytes must be a number >= 0, got {nbytes!r}")
    if isinstance(p, bool) or not isinstance(p, int) or p < 1:
        raise CostError(f"{kind}: group size must be a positive int, got {p!r}")


def form(kind: str, algorithm: str = "") -> Form:
    """The linear form of ``kind``, or of its variant ``algorithm`` (`sbpflow.comm.kinds`)."""
    spec = TABLE.get(kind)
    if spec is None or spec.form is None:
        raise CostError(f"{kind!r} has no linear alpha-beta form; one of "
                        f"{sorted(LINEAR_KINDS)}")
    if not algorithm:
        return spec.form
    try:
        return VARIANTS[(kind, algorithm)]
    except KeyError:
        raise CostError(f"no {algorithm!r} variant of {kind}; variants: "
                        f"{sorted(VARIANTS)}") from None


def latency_messages(kind: str, p: int, algorithm: str = "") -> int:
    """The α count of ``kind`` (variant ``algorithm``) on ``p`` ranks (linear kinds; 0 for
    p = 1)."""
    return 0 if p <= 1 else form(kind, algorithm).messages(p)


def volume(kind: str, nbytes: float, p: int, algorithm: str = "") -> float:
    """Bytes each rank sends (and receives) in ``kind`` (variant ``algorithm``) about ``nbytes``
    on ``p`` ranks (linear kinds; 0 for p = 1)."""
    return 0.0 if p <= 1 else form(kind, algorithm).volume(p) * nbytes


def collective_time(kind: str, nbytes: float, p: int, link: Link | CollectiveFit) -> float:
    """Seconds for ``kind`` about ``nbytes`` on a group of ``p`` ranks over ``link``: a `Link`
    ``(α, β)``, or a `CollectiveFit` ``(α, β, o)`` whose overhead ``o`` is added once."""
    _check(kind, nbytes, p)
    if p == 1:
        return 0.0
    if not isinstance(link, CollectiveFit):
        link = CollectiveFit(*link)
    if kind == "broadcast":
        a, b = link.alpha, link.beta
        levels = math.ceil(math.log2(p))
        binomial = levels * (a + nbytes * b)
        scatter_allgather = (levels + p - 1) * a + 2 * (p - 1) / p * nbytes * b
        return link.overhead + min(binomial, scatter_allgather)
    return linear_time(kind, p, link).time(nbytes)


class LinearTime(NamedTuple):
    """`collective_time` of a linear kind on one group and fit, for any ``nbytes``: found
    once per group by `linear_time` (a strategy search prices thousands of collectives on
    a few groups), the same floats as `CollectiveFit.time`."""

    base: float     # overhead + m·alpha
    volume: float   # per-rank bytes per byte the call is about (v / n)
    beta: float
    knee: float
    beta2: float

    def time(self, nbytes: float) -> float:
        """Seconds for a call about ``nbytes`` bytes."""
        return _seconds(self.base, self.volume * nbytes, self.beta, self.knee, self.beta2)


def linear_time(kind: str, p: int, fit: CollectiveFit) -> LinearTime:
    """`collective_time` of the linear ``kind`` on ``p`` ranks with ``fit``, as a `LinearTime`
    (free for one rank)."""
    if p <= 1:
        return LinearTime(0.0, 0.0, 0.0, 0.0, 0.0)
    f = form(kind, fit.algorithm)
    return LinearTime(fit.overhead + f.messages(p) * fit.alpha, f.volume(p), fit.beta, fit.knee,
                      fit.beta2)
