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
p2p             the message        ``α + n·β``                                     direct
==============  =================  ==============================================  ============

A one-rank group costs 0. Broadcast (``L = ⌈log2 p⌉``) is the faster of a binomial tree (small
messages) and van de Geijn's scatter + ring all-gather (large), as MPI libraries switch between.

The bandwidth term ``(p-1)/p·n`` (``2(p-1)/p·n``) is the number of bytes each rank sends and
receives; for a boxing step with uneven shards, `step_time` uses the exact per-rank count of the
Communicator's byte accounting instead and takes the busiest rank: ``messages·α + β·max_i
max(sent_i, recv_i)``. For even shards the two agree exactly.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Iterable

from ..boxing.boxes import box_numel, intersect
from ..boxing.planner import BoxingPlan
from ..boxing.steps import Step, member_boxes
from ..sbp import part
from .cluster import Cluster, CostError, Link

__all__ = ["KINDS", "collective_time", "latency_messages", "volume", "step_time", "plan_time",
           "step_groups"]

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "p2p")
_LINEAR = {  # kind -> (messages(p), per-rank bytes factor(p)) of the linear (non-broadcast) kinds
    "all_gather": (lambda p: p - 1, lambda p: (p - 1) / p),
    "reduce_scatter": (lambda p: p - 1, lambda p: (p - 1) / p),
    "all_to_all": (lambda p: p - 1, lambda p: (p - 1) / p),
    "all_reduce": (lambda p: 2 * (p - 1), lambda p: 2 * (p - 1) / p),
    "p2p": (lambda p: 1, lambda p: 1.0),
}


def _check(kind: str, nbytes: float, p: int) -> None:
    if kind not in KINDS:
        raise CostError(f"unknown collective kind {kind!r}; one of {KINDS}")
    if not (isinstance(nbytes, (int, float)) and nbytes >= 0):
        raise CostError(f"{kind}: nbytes must be a number >= 0, got {nbytes!r}")
    if isinstance(p, bool) or not isinstance(p, int) or p < 1:
        raise CostError(f"{kind}: group size must be a positive int, got {p!r}")
    if kind == "p2p" and p > 2:
        raise CostError(f"p2p is between 2 ranks, got a group of {p}")


def latency_messages(kind: str, p: int) -> int:
    """The α count of ``kind`` on ``p`` ranks (linear kinds; 0 for p = 1)."""
    if kind not in _LINEAR:
        raise CostError(f"{kind!r} has no linear alpha-beta form; one of {sorted(_LINEAR)}")
    return 0 if p <= 1 else _LINEAR[kind][0](p)


def volume(kind: str, nbytes: float, p: int) -> float:
    """Bytes each rank sends (and receives) in ``kind`` about ``nbytes`` on ``p`` ranks (linear
    kinds; 0 for p = 1)."""
    if kind not in _LINEAR:
        raise CostError(f"{kind!r} has no linear alpha-beta form; one of {sorted(_LINEAR)}")
    return 0.0 if p <= 1 else _LINEAR[kind][1](p) * nbytes


def collective_time(kind: str, nbytes: float, p: int, link: Link) -> float:
    """Seconds for ``kind`` about ``nbytes`` on a group of ``p`` ranks over ``link``."""
    _check(kind, nbytes, p)
    if p == 1:
        return 0.0
    a, b = link
    if kind == "broadcast":
        levels = math.ceil(math.log2(p))
        binomial = levels * (a + nbytes * b)
        scatter_allgather = (levels + p - 1) * a + 2 * (p - 1) / p * nbytes * b
        return min(binomial, scatter_allgather)
    return latency_messages(kind, p) * a + volume(kind, nbytes, p) * b


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
    for s, d, box in step.routes:
        n = box_numel(box) * step.itemsize
        if s == d or n == 0:
            continue  # a local copy / an empty message never touches the network
        t = cluster.collective_time("p2p", n, (s, d))
        busy[("send", s)] = busy.get(("send", s), 0.0) + t
        busy[("recv", d)] = busy.get(("recv", d), 0.0) + t
    return max(busy.values(), default=0.0)


@lru_cache(maxsize=1 << 16)
def _step_time(step: Step, cluster: Cluster) -> float:
    if step.kind == "local":
        return 0.0
    if step.kind == "transfer":
        return _transfer_time(step, cluster)
    worst = 0.0
    for g in step_groups(step):
        p = len(g)
        if p == 1:
            continue
        a, b = cluster.link(g)
        t = latency_messages(step.kind, p) * a + _member_bytes(step, g) * step.itemsize * b
        worst = max(worst, t)
    return worst


def step_time(step: Step, cluster: Cluster) -> float:
    """Seconds one boxing `Step` takes on ``cluster``.

    * ``local``: 0.
    * a collective: its groups (ranks differing only along ``step.dims``) run at once; the step
      takes as long as the slowest group. A group spanning nodes uses ``cluster.inter``, one
      inside a node ``cluster.intra``. Time of a group: the kind's α count (see the module
      table) plus β times the bytes its busiest rank sends or receives (exact for uneven shards;
      equal to the table's formula for even ones).
    * ``transfer``: each route between two different ranks is a p2p message (``α + n·β`` on the
      link of its pair); ranks send and receive in parallel, each rank's messages one after
      another: the time is the largest over ranks of a rank's total send or receive time.

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
