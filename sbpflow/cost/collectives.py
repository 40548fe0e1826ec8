"""Alpha-beta times of collectives, of boxing steps and of boxing plans.

For a group of ``p`` ranks on a link ``(α, β)`` and a tensor ``T`` of ``n`` bytes (what ``n`` is
depends on the kind, as in `sbpflow.comm.base`):

==============  =================  ==============================================  ============
kind            n                  time                                            algorithm
==============  =================  ==============================================  ============
all_gather      gathered result    ``(p-1)·α + (p-1)/p·n·β``                       ring
reduce_scatter  one rank's input   ``(p-1)·α + (p-1)/p·n·β``                       pairwise
all_reduce      one rank's input   ``2(p-1)·α + 2(p-1)/p·n·β``                     ring (RS+AG)
all_to_all      one rank's input   ``(p-1)·α + (p-1)/p·n·β``                       pairwise
broadcast       the message        ``min(L·(α+n·β), (L+p-1)·α + 2(p-1)/p·n·β)``    see below
p2p             one message        ``(p-1)·(α + n·β)`` (each rank: p-1 messages)   direct
==============  =================  ==============================================  ============

``p2p`` on ``p`` ranks is one exchange call in which every rank sends a message of ``n`` bytes to
each of the ``p-1`` others and receives one from each (``p = 2``: one message each way,
``α + n·β``). Messages to different peers are posted together but share the rank's link, so
they count one after another; a per-kind fit's overhead ``o`` is the call's cost. Measured over
several ``p`` (calibration), ``o`` and the per-message ``α`` come apart, which a boxing
``transfer`` needs: its busiest rank may exchange with one peer or with many. A rank's sends
and receives are taken to overlap (full-duplex links): a transfer costs its busiest rank's
larger direction.

A variant may replace a kind's formula when a per-kind fit names it: ``direct`` all-reduce,
``(p-1)·α + (p-1)·n·β`` (every rank receives and reduces every other rank's whole tensor).

A one-rank group costs 0. A cluster with a per-kind fit ``(α, β, o)`` for the kind and link
class (`Cluster.fit`) prices the kind with that α and β and adds the per-call overhead ``o`` to
the time (``o`` does not grow with ``p`` or ``n``), and a fit with a bend adds ``(v - knee)·β2``
for the per-rank bytes ``v`` past its knee (`CollectiveFit.time`). Broadcast (``L = ⌈log2 p⌉``)
is the faster of a binomial tree (small messages) and van de Geijn's scatter + ring all-gather
(large), as MPI libraries switch between.

The bandwidth term ``(p-1)/p·n`` (``2(p-1)/p·n``) is the number of bytes each rank sends and
receives; for a boxing step with uneven shards, `step_time` uses the exact per-rank count of the
Communicator's byte accounting instead and takes the busiest rank: ``messages·α + β·max_i
max(sent_i, recv_i)``. For even shards the two agree exactly.

Local copies: a collective step whose pieces are cut from the local shard along a split that is
not the leading axis of that shard (``prod(local_shape[:axis]) > 1``) must first copy them into
contiguous buffers (reduce-scatter and all-to-all inputs), and one that assembles received
pieces along such an axis of its output writes through strided views (all-gather and
all-to-all outputs); `step_time` adds ``copy_beta`` per byte so copied by the busiest rank
(`Cluster.copy_time`). Contiguous pieces cost nothing extra: the calibrated collectives already
include their contiguous copies.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Iterable

from ..boxing.boxes import box_numel, box_shape, intersect
from ..boxing.planner import BoxingPlan
from ..boxing.steps import Step, member_boxes
from ..sbp import Split, part
from .cluster import Cluster, CollectiveFit, CostError, Link

__all__ = ["KINDS", "ALGORITHMS", "collective_time", "latency_messages", "volume", "step_time", "plan_time",
           "step_groups"]

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "p2p")
_LINEAR = {  # kind -> (messages(p), per-rank bytes factor(p)) of the linear (non-broadcast) kinds
    "all_gather": (lambda p: p - 1, lambda p: (p - 1) / p),
    "reduce_scatter": (lambda p: p - 1, lambda p: (p - 1) / p),
    "all_to_all": (lambda p: p - 1, lambda p: (p - 1) / p),
    "all_reduce": (lambda p: 2 * (p - 1), lambda p: 2 * (p - 1) / p),
    "p2p": (lambda p: p - 1, lambda p: float(p - 1)),
}


def _check(kind: str, nbytes: float, p: int) -> None:
    if kind not in KINDS:
        raise CostError(f"unknown collective kind {kind!r}; one of {KINDS}")
    if not (isinstance(nbytes, (int, float)) and nbytes >= 0):
        raise CostError(f"{kind}: nbytes must be a number >= 0, got {nbytes!r}")
    if isinstance(p, bool) or not isinstance(p, int) or p < 1:
        raise CostError(f"{kind}: group size must be a positive int, got {p!r}")


# Algorithm variants: (kind, name) -> (messages(p), per-rank bytes factor(p)). "direct"
# all-reduce: every rank receives every other rank's whole tensor and reduces all of them
# itself ((p-1)·n a rank instead of the ring's 2(p-1)/p·n; the in-process threads backend works
# this way). Calibration picks the variant that fits the measurements better.
_VARIANTS = {
    ("all_reduce", "direct"): (lambda p: p - 1, lambda p: float(p - 1)),
}
ALGORITHMS = tuple(sorted({a for _, a in _VARIANTS}))


def _form(kind: str, algorithm: str = ""):
    if kind not in _LINEAR:
        raise CostError(f"{kind!r} has no linear alpha-beta form; one of {sorted(_LINEAR)}")
    if not algorithm:
        return _LINEAR[kind]
    try:
        return _VARIANTS[(kind, algorithm)]
    except KeyError:
        raise CostError(f"no {algorithm!r} variant of {kind}; variants: "
                        f"{sorted(_VARIANTS)}") from None


def latency_messages(kind: str, p: int, algorithm: str = "") -> int:
    """The α count of ``kind`` (variant ``algorithm``) on ``p`` ranks (linear kinds; 0 for
    p = 1)."""
    form = _form(kind, algorithm)
    return 0 if p <= 1 else form[0](p)


def volume(kind: str, nbytes: float, p: int, algorithm: str = "") -> float:
    """Bytes each rank sends (and receives) in ``kind`` (variant ``algorithm``) about ``nbytes``
    on ``p`` ranks (linear kinds; 0 for p = 1)."""
    form = _form(kind, algorithm)
    return 0.0 if p <= 1 else form[1](p) * nbytes


def collective_time(kind: str, nbytes: float, p: int, link: Link | CollectiveFit) -> float:
    """Seconds for ``kind`` about ``nbytes`` on a group of ``p`` ranks over ``link``: a `Link`
    ``(α, β)``, or a `CollectiveFit` ``(α, β, o)`` whose overhead ``o`` is added once."""
    _check(kind, nbytes, p)
    if p == 1:
        return 0.0
    if not isinstance(link, CollectiveFit):
        link = CollectiveFit(*link)
    a, b, algo = link.alpha, link.beta, link.algorithm
    if kind == "broadcast":
        levels = math.ceil(math.log2(p))
        binomial = levels * (a + nbytes * b)
        scatter_allgather = (levels + p - 1) * a + 2 * (p - 1) / p * nbytes * b
        return link.overhead + min(binomial, scatter_allgather)
    return link.time(latency_messages(kind, p, algo), volume(kind, nbytes, p, algo))


# -- boxing steps and plans -----------------------------------------------------------------------
def step_groups(step: Step) -> list[tuple[int, ...]]:
    """The disjoint groups of ranks a same-placement step runs its collective in (along
    ``step.dims``), in mesh order."""
    pl = step.src_placement
    seen, out = set(), []
    for c in pl.coords():
        g = pl.group(step.dims, c)
        if g not in seen:
            seen.add(g)
            out.append(g)
    return out


def _member_bytes(step: Step, g: tuple[int, ...]) -> int:
    """Elements the busiest member of ``g`` sends or receives (the Communicator's accounting)."""
    src = member_boxes(step.shape, step.src_placement, step.src)
    dst = member_boxes(step.shape, step.dst_placement, step.dst)
    p = len(g)
    busiest = 0
    for i, r in enumerate(g):
        if step.kind == "all_gather":
            sent = (p - 1) * box_numel(src[r])
            recv = sum(box_numel(src[q]) for q in g if q != r)
        elif step.kind == "reduce_scatter":
            sent = sum(box_numel(dst[q]) for q in g if q != r)
            recv = (p - 1) * box_numel(dst[r])
        elif step.kind == "all_reduce":
            n = box_numel(src[r])
            chunk = part(n, p, i)[1]
            sent = recv = n - chunk + (p - 1) * chunk
        elif step.kind == "all_to_all":
            sent = sum(box_numel(intersect(src[r], dst[q])) for q in g if q != r)
            recv = sum(box_numel(intersect(src[q], dst[r])) for q in g if q != r)
        else:
            raise CostError(f"no time model for boxing step kind {step.kind!r}")
        busiest = max(busiest, sent, recv)
    return busiest


def _transfer_time(step: Step, cluster: Cluster) -> float:
    busy: dict[tuple[str, int], float] = {}
    received: dict[int, int] = {}
    overhead = 0.0
    for s, d, box in step.routes:
        n = box_numel(box) * step.itemsize
        if s == d or n == 0:
            continue  # a local copy / an empty message never touches the network
        fit = cluster.fit("p2p", (s, d))
        t = fit.time(1, n) - fit.overhead
        overhead = max(overhead, fit.overhead)  # all messages go in one exchange call: paid once
        busy[("send", s)] = busy.get(("send", s), 0.0) + t
        busy[("recv", d)] = busy.get(("recv", d), 0.0) + t
        received[d] = received.get(d, 0) + n
    if not busy:
        return 0.0
    # the receiver then writes its pieces into its output shard (a copy the exchange's
    # calibration does not include)
    return overhead + max(busy.values()) + cluster.copy_time(max(received.values()))


def strided(local_shape: Iterable[int], axis: int) -> bool:
    """Whether pieces of a tensor of ``local_shape`` cut along ``axis`` are non-contiguous
    views (some axis before ``axis`` has more than one element)."""
    return math.prod(tuple(local_shape)[:axis]) > 1


def _copy_bytes(step: Step, r: int) -> int:
    """Bytes rank ``r`` copies through strided views: the input of a reduce-scatter or
    all-to-all cut along a non-leading axis of the local shard, the output of an all-gather or
    all-to-all assembled along one (0 when every piece is a contiguous block)."""
    n = 0
    src = member_boxes(step.shape, step.src_placement, step.src)[r]
    dst = member_boxes(step.shape, step.dst_placement, step.dst)[r]
    if step.kind in ("reduce_scatter", "all_to_all"):
        axes = {step.dst[d].axis for d in step.dims if isinstance(step.dst[d], Split)}
        if any(strided(box_shape(src), a) for a in axes):
            n += box_numel(src)  # every piece, this rank's own included, is cut
    if step.kind in ("all_gather", "all_to_all"):
        axes = {step.src[d].axis for d in step.dims if isinstance(step.src[d], Split)}
        if any(strided(box_shape(dst), a) for a in axes):
            n += box_numel(dst)  # every piece, this rank's own included, is written
    return n * step.itemsize


@lru_cache(maxsize=1 << 16)
def _step_time(step: Step, cluster: Cluster) -> float:
    return cluster.step_overhead + _comm_time(step, cluster)


def _comm_time(step: Step, cluster: Cluster) -> float:
    if step.kind == "local":
        return 0.0
    if step.kind == "transfer":
        return _transfer_time(step, cluster)
    worst = 0.0
    for g in step_groups(step):
        p = len(g)
        if p == 1:
            continue
        fit = cluster.fit(step.kind, g)
        algo = fit.algorithm
        if algo:  # a variant's own per-rank volume of the busiest member's tensor
            n = max(box_numel(member_boxes(step.shape, step.src_placement, step.src)[r])
                    for r in g) * step.itemsize
            moved = volume(step.kind, n, p, algo)
        else:
            moved = _member_bytes(step, g) * step.itemsize
        t = fit.time(latency_messages(step.kind, p, algo), moved)
        if cluster.copy_beta:
            t += cluster.copy_time(max(_copy_bytes(step, r) for r in g))
        worst = max(worst, t)
    return worst


def step_time(step: Step, cluster: Cluster) -> float:
    """Seconds one boxing `Step` takes on ``cluster``: ``cluster.step_overhead`` (0 unless
    calibrated) plus

    * ``local``: 0.
    * a collective: its groups (ranks differing only along ``step.dims``) run at once; the step
      takes as long as the slowest group. A group spanning nodes uses ``cluster.inter``, one
      inside a node ``cluster.intra``. Time of a group: the kind's α count (see the module
      table) plus β times the bytes its busiest rank sends or receives (exact for uneven shards;
      equal to the table's formula for even ones), plus the kind's per-call overhead if the
      cluster has a per-kind fit, plus ``copy_beta`` times the bytes the busiest rank copies to
      cut non-contiguous pieces (module doc).
    * ``transfer``: each route between two different ranks is a p2p message (``α + n·β`` on the
      link of its pair); ranks send and receive in parallel, each rank's messages one after
      another: the time is the largest over ranks of a rank's total send or receive time, plus
      the p2p fit's per-call overhead once (all messages are one exchange call), plus
      ``copy_beta`` times the bytes the busiest receiver writes into its output shard.

    Raises `CostError` if a rank of the step is outside the cluster.
    """
    if not isinstance(step, Step):
        raise CostError(f"step_time needs a boxing Step, got {type(step).__name__}")
    if not isinstance(cluster, Cluster):
        raise CostError(f"step_time needs a Cluster, got {type(cluster).__name__}")
    return _step_time(step, cluster)


def plan_time(plan: BoxingPlan | Iterable[Step], cluster: Cluster) -> float:
    """Seconds a boxing plan takes: the sum of its steps' `step_time` (steps run one after
    another). Accepts a `BoxingPlan` or any iterable of steps."""
    steps = plan.steps if isinstance(plan, BoxingPlan) else plan
    return sum((step_time(s, cluster) for s in steps), 0.0)
