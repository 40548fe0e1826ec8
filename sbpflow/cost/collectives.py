"""Alpha-beta times of boxing steps and plans (the formulas of one collective: `formulas`).

A same-placement step runs its kind's collective in every group at once; `step_time` prices a
group with the kind's α count and β times the bytes its busiest member sends or receives, exact
for uneven shards by the kind's traffic rule (`sbpflow.comm.kinds`, what the Communicator
counts; for even shards it equals the formula's ``v(p)·n``). A ``transfer`` is one exchange
call of p2p messages: each costs ``α + n·β`` on the link of its pair, a rank's messages count
one after another, its sends and receives overlap (full-duplex), and the p2p fit's overhead is
paid once. Local copies: pieces cut from (or assembled into) a shard along a split that is not
its leading axis (``prod(local_shape[:axis]) > 1``) go through strided views, and cost
``copy_beta`` a byte so copied by the busiest rank (`Cluster.copy_time`); contiguous pieces
cost nothing extra (the calibrated collectives include their contiguous copies).
"""

from __future__ import annotations

import math
from typing import Iterable

from ..boxing.boxes import box_numel, box_shape
from ..boxing.planner import BoxingPlan
from ..boxing.steps import BoxingStep, member_boxes, member_traffic, placement_groups
from ..caches import memoize
from ..comm.kinds import BOXING_KINDS
from ..sbp import Split
from .cluster import Cluster
from .formulas import (ALGORITHMS, KINDS, CostError, collective_time, latency_messages,
                       volume)

__all__ = ["KINDS", "ALGORITHMS", "collective_time", "latency_messages", "volume", "step_time",
           "plan_time", "step_groups"]


# -- boxing steps and plans -----------------------------------------------------------------------
def step_groups(step: BoxingStep) -> list[tuple[int, ...]]:
    """The disjoint groups of ranks a same-placement step runs its collective in (along
    ``step.dims``), in mesh order."""
    return list(placement_groups(step.src_placement, step.dims))


def _member_bytes(step: BoxingStep, g: tuple[int, ...]) -> int:
    """Elements the busiest member of ``g`` sends or receives (the Communicator's accounting)."""
    if step.kind not in BOXING_KINDS:
        raise CostError(f"no time model for boxing step kind {step.kind!r}")
    return max(max(t) for t in member_traffic(step, g))


def _transfer_time(step: BoxingStep, cluster: Cluster) -> float:
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


def _copy_bytes(step: BoxingStep, r: int) -> int:
    """Bytes rank ``r`` copies through strided views: the input of a reduce-scatter or
    all-to-all cut along a non-leading axis of the local shard, the output of an all-gather or
    all-to-all assembled along one (0 when every piece is a contiguous block)."""
    n = 0
    src = member_boxes(step.shape, step.src_placement, step.src_sbp)[r]
    dst = member_boxes(step.shape, step.dst_placement, step.dst_sbp)[r]
    if step.kind in ("reduce_scatter", "all_to_all"):
        axes = {step.dst_sbp[d].axis for d in step.dims if isinstance(step.dst_sbp[d], Split)}
        if any(strided(box_shape(src), a) for a in axes):
            n += box_numel(src)  # every piece, this rank's own included, is cut
    if step.kind in ("all_gather", "all_to_all"):
        axes = {step.src_sbp[d].axis for d in step.dims if isinstance(step.src_sbp[d], Split)}
        if any(strided(box_shape(dst), a) for a in axes):
            n += box_numel(dst)  # every piece, this rank's own included, is written
    return n * step.itemsize


@memoize(1 << 16)
def _step_time(step: BoxingStep, cluster: Cluster) -> float:
    return cluster.step_overhead + _comm_time(step, cluster)


def _comm_time(step: BoxingStep, cluster: Cluster) -> float:
    if step.kind == "local":
        return 0.0
    if step.kind == "transfer":
        return _transfer_time(step, cluster)
    worst = 0.0
    for g in placement_groups(step.src_placement, step.dims):  # no list copy per step
        p = len(g)
        if p == 1:
            continue
        fit = cluster.fit(step.kind, g)
        algo = fit.algorithm
        if algo:  # a variant's own per-rank volume of the busiest member's tensor
            n = max(box_numel(member_boxes(step.shape, step.src_placement, step.src_sbp)[r])
                    for r in g) * step.itemsize
            moved = volume(step.kind, n, p, algo)
        else:
            moved = _member_bytes(step, g) * step.itemsize
        t = fit.time(latency_messages(step.kind, p, algo), moved)
        if cluster.copy_beta:
            t += cluster.copy_time(max(_copy_bytes(step, r) for r in g))
        worst = max(worst, t)
    return worst


def step_time(step: BoxingStep, cluster: Cluster) -> float:
    """Seconds one `BoxingStep` takes on ``cluster``: ``cluster.step_overhead`` (0 unless
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
    if not isinstance(step, BoxingStep):
        raise CostError(f"step_time needs a BoxingStep, got {type(step).__name__}")
    if not isinstance(cluster, Cluster):
        raise CostError(f"step_time needs a Cluster, got {type(cluster).__name__}")
    return _step_time(step, cluster)


def plan_time(plan: BoxingPlan | Iterable[BoxingStep], cluster: Cluster) -> float:
    """Seconds a boxing plan takes: the sum of its steps' `step_time` (steps run one after
    another). Accepts a `BoxingPlan` or any iterable of steps."""
    steps = plan.steps if isinstance(plan, BoxingPlan) else plan
    return sum((step_time(s, cluster) for s in steps), 0.0)
