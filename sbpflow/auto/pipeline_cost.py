"""Pipelined strategies: the layer chain cut into stages, each on its own consecutive devices,
``M`` micro-batches a step run by GPipe or 1F1B; their step time and memory per device.

Step time = ``(M + S - 1)`` x the slowest stage's time per micro-batch (compute and its
layers' redistributions, `Evaluator` on the stage's devices) + the stage-to-stage transfers of
one micro-batch, forward and backward (the fill and drain of the pipeline; in steady state they
overlap compute) + the slowest stage's gradient sync. Memory per device per stage: its weights,
gradients and optimizer state, plus the activations of the micro-batches it keeps in flight
(`sbpflow.auto.space.Pipeline.in_flight`). See docs/auto.md, 'Pipeline stages'.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

from ..sbp import Partial, S, Split
from .evaluate import Breakdown, Evaluator
from .evaluate import evaluate as _evaluate_one
from .graph import Graph

__all__ = ["evaluate", "balanced_cuts", "sub_cluster", "stage_graph", "stage_ranges", "StageCost",
           "stage_cost", "transfer_time", "combine"]


def sub_cluster(cluster, devices: int):
    """The cluster of one stage's ``devices`` consecutive ranks (whole nodes, or a part of a
    node dividing it), or None when a stage would straddle a node boundary unevenly."""
    dpn = cluster.devices_per_node
    if devices >= dpn:
        if devices % dpn or cluster.world_size % devices:
            return None
        return dataclasses.replace(cluster, nodes=devices // dpn)
    if dpn % devices:
        return None
    return dataclasses.replace(cluster, nodes=1, devices_per_node=devices)


def stage_graph(graph, start: int, end: int) -> Graph:
    """Layers ``start:end`` of a chain ``graph`` as a graph of their own (its last layer is a
    sink: a partial output is reduced before it leaves the stage)."""
    return Graph(graph.layers[start:end], name=f"{graph.name}[{start}:{end}]",
                 itemsize=graph.itemsize, optimizer_states=graph.optimizer_states,
                 optimizer_itemsize=graph.optimizer_itemsize)


def stage_ranges(strategy) -> list:
    """``[(start, end)]`` of each stage's layers (contiguous, stages in order)."""
    out, start = [], 0
    stages = [s.stage for s in strategy.layers]
    for k in range(strategy.stages):
        end = start
        while end < len(stages) and stages[end] == k:
            end += 1
        if end == start:
            raise ValueError(f"stage {k} of a {strategy.stages}-stage strategy has no layers "
                             "(stages must be contiguous, in order)")
        out.append((start, end))
        start = end
    if start != len(stages):
        raise ValueError("layer stages must be 0, 1, ... in chain order")
    return out


class StageCost(NamedTuple):
    """One stage: time per micro-batch, gradient sync per step, memory per device (with
    ``in_flight`` micro-batches of activations) and its one-stage breakdown."""

    micro_time: float
    grad_sync: float
    memory: dict
    breakdown: Breakdown


def stage_cost(breakdown: Breakdown, micro_batches: int, in_flight: int) -> StageCost:
    """`StageCost` from a stage's one-stage breakdown at ``micro_batches`` (whose activation
    memory is one micro-batch's)."""
    b = breakdown
    mem = dict(b.memory)
    mem["activations"] = b.memory["activations"] * in_flight
    mem["total"] = mem["params"] + mem["grads"] + mem["optimizer"] + mem["activations"]
    # ZeRO weight gathers run in every micro-batch's forward and backward: on the critical
    # path of each, not once per step like the gradient sync
    t = (b.compute_time + b.forward_time + b.backward_time + b.gather_time) / micro_batches
    return StageCost(t, b.grad_sync_time - b.gather_time, mem, b)


def _sent_layout(nd: tuple) -> tuple:
    """What a stage sends of its last output: partial dims reduced (scattered on axis 0),
    as the sink reduction of `Evaluator.node_terms` prices."""
    return tuple(S(0) if isinstance(x, Partial) else x for x in nd)


def _factors(shape, mesh, nd) -> list:
    f = [1] * len(shape)
    for x, m in zip(nd, mesh):
        if isinstance(x, Split):
            f[min(x.axis, len(shape) - 1)] *= m
    return f


def transfer_time(cluster, shape: tuple, itemsize: int, micro_batches: int, src: tuple,
                  dst: tuple, ranks: tuple) -> float:
    """Seconds to send one micro-batch of a tensor of ``shape`` from ``src = (mesh, nd-sbp)``
    on one stage to ``dst`` on the next (``ranks``: a rank of each), point to point: each
    receiver gets its destination shard in one message from each source shard it meets
    (estimate: ``prod max(1, fs / fd)`` over axes), all receivers at once over the link the
    two stages share (the per-kind ``p2p`` fit when the cluster has one)."""
    fs, fd = _factors(shape, *src), _factors(shape, *dst)
    nbytes = math.prod(shape) * itemsize / micro_batches / math.prod(fd)
    msgs = math.prod(max(1, a // b) for a, b in zip(fs, fd))
    return cluster.fit("p2p", ranks).time(msgs, nbytes)


def combine(costs: list, transfers: list, pipeline) -> tuple[float, float]:
    """``(step time, bubble)`` of stages ``costs`` and boundary transfer times (forward plus
    backward of one micro-batch each)."""
    m, s = pipeline.micro_batches, pipeline.stages
    slow = max(c.micro_time for c in costs)
    bubble = (s - 1) * slow
    return (m + s - 1) * slow + sum(transfers) + max(c.grad_sync for c in costs), bubble


def _boundary(graph, strategy, a: int, b: int, cluster, pipeline, k: int) -> float:
    """Forward and backward transfer of one micro-batch between stage k (last layer a) and
    stage k + 1 (first layer b)."""
    la, sa, sb = graph.layers[a], strategy.layers[a], strategy.layers[b]
    shape = tuple(la.output_shape)
    d = pipeline.devices
    ranks = (k * d, (k + 1) * d)
    src = (sa.mesh, _sent_layout(sa.output))
    dst = (sb.mesh, _sent_layout(sb.input))
    it, m = graph.itemsize, pipeline.micro_batches
    return transfer_time(cluster, shape, it, m, src, dst, ranks) + \
        transfer_time(cluster, shape, it, m, dst, src, ranks[::-1])


def _stage_breakdowns(graph, strategy, cluster, pipeline, ranges):
    sub = sub_cluster(cluster, pipeline.devices)
    if sub is None:
        raise ValueError(f"{pipeline.stages} stages of {pipeline.devices} devices do not "
                         f"tile {cluster} by whole nodes or equal parts of a node")
    out = []
    for k, (a, b) in enumerate(ranges):
        g = stage_graph(graph, a, b)
        bd = Evaluator(g, sub, pipeline.micro_batches).breakdown(strategy.layers[a:b])
        out.append(stage_cost(bd, pipeline.micro_batches, pipeline.in_flight(k)))
    return out


def _pipeline_breakdown(graph, strategy, cluster) -> Breakdown:
    pp = strategy.pipeline
    if pp.stages * pp.devices != cluster.world_size:
        raise ValueError(f"{pp.stages} stages x {pp.devices} devices != the cluster's "
                         f"{cluster.world_size}")
    if not graph.is_chain:
        raise ValueError(f"{graph.name}: pipeline stages need a chain of layers")
    ranges = stage_ranges(strategy)
    costs = _stage_breakdowns(graph, strategy, cluster, pp, ranges)
    transfers = [_boundary(graph, strategy, ranges[k][1] - 1, ranges[k + 1][0], cluster, pp, k)
                 for k in range(len(ranges) - 1)]
    time, bubble = combine(costs, transfers, pp)
    r = Breakdown(micro_batches=pp.micro_batches, stages=pp.stages, schedule=pp.schedule)
    for c in costs:
        b = c.breakdown
        r.compute_time += b.compute_time
        r.forward_time += b.forward_time
        r.backward_time += b.backward_time
        r.grad_sync_time += b.grad_sync_time
        r.gather_time += b.gather_time
        r.forward_bytes += b.forward_bytes
        r.backward_bytes += b.backward_bytes
        r.grad_sync_bytes += b.grad_sync_bytes
        r.per_layer.update(b.per_layer)
        r.stage_times.append(c.micro_time)
        r.stage_memory.append(c.memory["total"])
    r.memory = max((c.memory for c in costs), key=lambda m: m["total"])
    r.transfer_time, r.bubble_time, r.time = sum(transfers), bubble, time
    return r


def evaluate(graph, strategy, cluster, micro_batches: int = 1) -> Breakdown:
    """The predicted time, bytes per device and memory per device of ``strategy``, with or
    without pipeline stages (``micro_batches``: a one-stage strategy's gradient accumulation;
    a pipeline's count is its own). For a pipeline the times and bytes other than ``time``
    are sums over its stages (each stage's devices do their own), ``memory`` the fullest
    stage's, and ``stage_times``, ``stage_memory``, ``transfer_time``, ``bubble_time`` say
    the rest."""
    if getattr(strategy, "pipeline", None) is None:
        return _evaluate_one(graph, strategy, cluster, micro_batches)
    return _pipeline_breakdown(graph, strategy, cluster)


def balanced_cuts(weights: list, stages: int, points: list) -> list | None:
    """Stage starts (from ``points``) cutting ``weights`` into ``stages`` contiguous parts
    whose largest sum is least (bisection on that sum, greedy fill); None if impossible."""
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    if len(points) < stages - 1:
        return None

    def fill(cap):
        starts, last = [0], 0
        for i, pt in enumerate(points):
            nxt = points[i + 1] if i + 1 < len(points) else len(weights)
            if prefix[nxt] - prefix[last] > cap and len(starts) < stages:
                starts.append(pt)
                last = pt
        if prefix[len(weights)] - prefix[last] > cap * (1 + 1e-9):
            return None
        return starts
    lo, hi = max(weights) if weights else 0.0, prefix[-1]
    best = fill(hi)
    for _ in range(60):
        mid = (lo + hi) / 2
        got = fill(mid)
        if got is not None:
            best, hi = got, mid
        else:
            lo = mid
    if best is None:
        return None
    # exactly ``stages`` parts: split the longest remaining parts at free points
    free = [pt for pt in points if pt not in best]
    while len(best) < stages and free:
        best.append(free.pop(len(free) // 2))
        best.sort()
    return best if len(best) == stages else None
