"""Expert strategies as points of the space: data parallel and Megatron t x d."""

from __future__ import annotations

import math

from .evaluate import evaluate
from .space import Strategy, make_layer_strategy

__all__ = ["data_parallel", "megatron", "best_megatron"]


def _build(graph, mesh, roles):
    out = []
    for layer in graph.layers:
        names = tuple(roles(layer))
        s = make_layer_strategy(layer, mesh, names)
        for i in range(len(names)):   # e.g. more data-parallel ranks than sequences: replicate
            if s is None:
                names = names[:i] + ("rep",) + names[i + 1:]
                s = make_layer_strategy(layer, mesh, names)
        if s is None:
            raise ValueError(f"layer {layer.name}: {names} does not fit mesh {mesh}")
        out.append(s)
    return Strategy(graph, out)


def data_parallel(graph, cluster) -> Strategy:
    """Every layer splits its batch over all devices; weights replicated (all-reduced)."""
    return _build(graph, (cluster.world_size,), lambda l: ("dp",))


def megatron(graph, cluster, tp: int, dp: int | None = None) -> Strategy:
    """Megatron-LM: mesh (dp, tp), data parallel across dim 0 (outer, across nodes) and
    tensor parallel inside dim 1 with the layer's Megatron role (column / row / heads /
    vocab; conv out-channels)."""
    p = cluster.world_size
    dp = dp if dp is not None else p // tp
    if dp * tp != p:
        raise ValueError(f"tp {tp} x dp {dp} != {p} devices")
    if tp == 1:
        return data_parallel(graph, cluster)
    if dp == 1:
        return _build(graph, (tp,), lambda l: (l.attrs.get("megatron", "col"),))
    return _build(graph, (dp, tp), lambda l: ("dp", l.attrs.get("megatron", "col")))


def best_megatron(graph, cluster, memory_limit: float | None = None):
    """The best Megatron t x d (least predicted time) under the memory limit; returns
    (strategy, breakdown, tp) or None if no t x d fits."""
    if memory_limit is None:
        memory_limit = getattr(cluster, "memory_per_device", None)
    p, best = cluster.world_size, None
    for tp in range(1, p + 1):
        if p % tp:
            continue
        try:
            s = megatron(graph, cluster, tp)
        except ValueError:
            continue
        b = evaluate(graph, s, cluster)
        if memory_limit is not None and not math.isinf(memory_limit) and \
                b.memory["total"] > memory_limit:
            continue
        if best is None or b.time < best[1].time:
            best = (s, b, tp)
    return best
