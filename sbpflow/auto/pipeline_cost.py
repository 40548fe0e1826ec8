"""Pipelined strategies: the layer chain cut into stages, each on its own consecutive devices,
``M`` micro-batches a step run by GPipe or 1F1B; their step time and memory per device.

Step time = ``(M + S - 1)`` x the slowest stage's time per micro-batch (compute and its
layers' redistributions, `Evaluator` on the stage's devices) + the stage-to-stage transfers of
one micro-batch, forward and backward (the fill and drain of the pipeline; in steady state they
overlap compute) + the slowest stage's gradient sync + one gradient exchange per tie whose
holder is in another stage (that stage holds its own copy of the weight, in its memory and its
gradient sync). Memory per device per stage: its weights, gradients and optimizer state, plus
the activations of the micro-batches it keeps in flight
(`sbpflow.auto.space.PipelineShape.in_flight`). See docs/auto.md, 'Pipeline stages'.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

from ..cost.formulas import volume
from ..errors import GraphError
from ..layouts import MeshLayout
from ..sbp import B, Partial, S, Split
from .evaluate import Breakdown, Evaluator
from .evaluate import evaluate as _evaluate_one
from .layer_graph import LayerGraph
from .space import _tied_weight, check_whole_sequences, weight_layout

__all__ = ["evaluate", "balanced_cuts", "sub_cluster", "stage_graph", "stage_ranges", "StageCost",
           "stage_cost", "transfer_time", "combine", "stage_layers", "tie_sync"]


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


def stage_graph(graph, start: int, end: int) -> LayerGraph:
    """Layers ``start:end`` of a chain ``graph`` as a graph of their own (its last layer is a
    sink: a partial output is reduced before it leaves the stage). A tied layer whose holder
    is in another stage gets its own copy of the weight (`_own_copy`): stages run on disjoint
    devices, so each holds the weight it uses."""
    layers = [_own_copy(graph, l) if _tie_elsewhere(graph, l, start, end) else l
              for l in graph.layers[start:end]]
    return LayerGraph(layers, name=f"{graph.name}[{start}:{end}]",
                 itemsize=graph.itemsize, optimizer_states=graph.optimizer_states,
                 optimizer_itemsize=graph.optimizer_itemsize)


def _tie_elsewhere(graph, layer, start: int, end: int) -> bool:
    """Whether ``layer`` is tied to a layer of ``graph`` outside ``start:end``."""
    h = graph.index.get(layer.tied) if layer.tied is not None else None
    return h is not None and not start <= h < end


def _own_copy(graph, layer):
    """``layer`` with the weight of its holder as it uses it (a linear: ``(d_in, d_out)``,
    so an embedding's ``(vocab, d)`` is a head's ``(d, vocab)``), no longer tied."""
    holder = graph[layer.tied]
    shape = (layer.input_shape[-1], layer.output_shape[-1]) if layer.kind == "linear" \
        else tuple(holder.weight_shape)
    if math.prod(shape) != holder.params:
        raise GraphError(f"layer {layer.name} ({layer.kind}, input {tuple(layer.input_shape)}, "
                         f"output {tuple(layer.output_shape)}) uses a weight of shape {shape}, "
                         f"but its holder {holder.name} has {tuple(holder.weight_shape)}: tie "
                         "layers whose weights have the same elements")
    return dataclasses.replace(layer, tied=None, weight_shape=shape)


def stage_layers(graph, strategy, start: int, end: int) -> list:
    """The layer strategies of ``stage_graph(graph, start, end)``: a tied layer that got its
    own copy runs with the weight layout its signature gives (`space._tied_weight`; all
    replicated when no single one does)."""
    out = []
    for l, x in zip(graph.layers[start:end], strategy.layers[start:end]):
        if x.weight is None and _tie_elsewhere(graph, l, start, end):
            w = _tied_weight(l, x) or (B,) * len(x.mesh)
            x = dataclasses.replace(x, weight=w)
        out.append(x)
    return out


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


def transfer_time(cluster, shape: tuple, itemsize: int, micro_batches: int, src: MeshLayout,
                  dst: MeshLayout, ranks: tuple) -> float:
    """Seconds to send one micro-batch of a tensor of ``shape`` from layout ``src`` (a
    `MeshLayout` or ``(mesh, nd-sbp)`` pair) on one stage to ``dst`` on the next (``ranks``:
    a rank of each), point to point: each receiver gets its destination shard in one message
    from each source shard it meets
    (estimate: ``prod max(1, fs / fd)`` over axes), all receivers at once over the link the
    two stages share (the per-kind ``p2p`` fit when the cluster has one)."""
    fs, fd = _factors(shape, *src), _factors(shape, *dst)
    nbytes = math.prod(shape) * itemsize / micro_batches / math.prod(fd)
    msgs = math.prod(max(1, a // b) for a, b in zip(fs, fd))
    return cluster.fit("p2p", ranks).time(msgs, nbytes)


def combine(costs: list, transfers: list, pipeline, tie_time: float = 0.0) -> tuple[float, float]:
    """``(step time, bubble)`` of stages ``costs``, boundary transfer times (forward plus
    backward of one micro-batch each) and ``tie_time``, the gradient exchange of weights tied
    across stages (`tie_sync`), once a step after the stages' own syncs."""
    m, s = pipeline.micro_batches, pipeline.stages
    slow = max(c.micro_time for c in costs)
    bubble = (s - 1) * slow
    return (m + s - 1) * slow + sum(transfers) + max(c.grad_sync for c in costs) + tie_time, \
        bubble


def _stored_layout(layer, s) -> MeshLayout:
    """The `MeshLayout` (in the module's axes) of ``s``'s gradient after its stage's sync (the
    stored layout: ZeRO's shard, else the kernel's)."""
    return weight_layout(layer, dataclasses.replace(s, weight=s.weight_stored, stored=None))


def tie_sync(graph, strategy, cluster, pipeline, ranges) -> tuple[float, float]:
    """``(seconds, bytes per device)`` a step of exchanging the gradients of the copies of
    each weight tied across stages. Same mesh and shards (layouts in the module's axes):
    Megatron's embedding group, one 2-party all-reduce per shard pair (all at once) over the
    link between the stages' first ranks. Different shards: each copy's gradient sent to the
    other stage in that stage's layout, one way then the other (`transfer_time`: the stages'
    devices are disjoint, so even a slice of a replicated gradient crosses the link)."""
    stage_of = {i: k for k, (a, b) in enumerate(ranges) for i in range(a, b)}
    d, it = pipeline.devices, graph.itemsize
    t = nb = 0.0
    for i, l in enumerate(graph.layers):
        h = graph.index.get(l.tied) if l.tied is not None else None
        if h is None or stage_of[h] == stage_of[i]:
            continue
        a, b = ranges[stage_of[i]]
        ts = stage_layers(graph, strategy, a, b)[i - a]
        src = _stored_layout(graph.layers[h], strategy.layers[h])
        dst = _stored_layout(_own_copy(graph, l), ts)
        shape, ranks = _module_shape(graph.layers[h]), (stage_of[h] * d, stage_of[i] * d)
        if src == dst:
            n = math.prod(shape) / math.prod(_factors(shape, *src)) * it
            t += cluster.collective_time("all_reduce", n, ranks)
            nb += volume("all_reduce", n, 2)
            continue
        t += transfer_time(cluster, shape, it, 1, src, dst, ranks) + \
            transfer_time(cluster, shape, it, 1, dst, src, ranks[::-1])
        nb += sum(math.prod(shape) * it / math.prod(_factors(shape, *x)) for x in (src, dst))
    return t, nb


def _module_shape(layer) -> tuple:
    """A weight's shape in the module's axes (a linear's ``(d_in, d_out)`` is ``(out, in)``)."""
    w = tuple(layer.weight_shape)
    return w[::-1] if layer.kind == "linear" else w


def _boundary(graph, strategy, a: int, b: int, cluster, pipeline, k: int) -> float:
    """Forward and backward transfer of one micro-batch between stage k (last layer a) and
    stage k + 1 (first layer b)."""
    la, sa, sb = graph.layers[a], strategy.layers[a], strategy.layers[b]
    shape = tuple(la.output_shape)
    d = pipeline.devices
    ranks = (k * d, (k + 1) * d)
    src = MeshLayout(sa.mesh, _sent_layout(sa.output))
    dst = MeshLayout(sb.mesh, _sent_layout(sb.input))
    it, m = graph.itemsize, pipeline.micro_batches
    return transfer_time(cluster, shape, it, m, src, dst, ranks) + \
        transfer_time(cluster, shape, it, m, dst, src, ranks[::-1])


def _stage_breakdowns(graph, strategy, cluster, pipeline, ranges):
    sub = sub_cluster(cluster, pipeline.devices)
    if sub is None:
        raise ValueError(f"{pipeline.stages} stages of {pipeline.devices} devices do not "
                         f"tile {cluster} by whole nodes or equal parts of a node")
    out, shared = [], {}   # equal stages (a GPT's middle blocks) are priced once
    for k, (a, b) in enumerate(ranges):
        g = stage_graph(graph, a, b)
        bd = Evaluator(g, sub, pipeline.micro_batches, shared).breakdown(
            stage_layers(graph, strategy, a, b))
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
    tie_t, tie_b = tie_sync(graph, strategy, cluster, pp, ranges)
    time, bubble = combine(costs, transfers, pp, tie_t)
    r = Breakdown(micro_batches=pp.micro_batches, stages=pp.stages, schedule=pp.schedule,
                  grad_sync_time=tie_t, grad_sync_bytes=tie_b)
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
    pp = getattr(strategy, "pipeline", None)
    check_whole_sequences(graph, micro_batches if pp is None else pp.micro_batches)
    if pp is None:
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
