"""Tied weights of a strategy (`sf.auto.parallelize`): a tied layer and its holder on one layout.

`tie_weights` keeps a tied layer's strategy when it accepts its holder's weight layout (same
mesh, input and output), else re-chooses both as the pair of least time near them (node and
edge times, the other layers fixed) over the layouts both accept. Across pipeline stages each
stage keeps a copy of the weight, laid out alike (`sbpflow.parallel.tie`). See docs/auto.md,
'Tied weights'.
"""

from __future__ import annotations

import dataclasses

from ..errors import ParallelizeError
from ..layouts import MeshLayout
from .model_layout import module_nd
from .space import Strategy, layer_space
from .stage_cuts import restrategy
from .trace import graph_weight_shape

__all__ = ["near_cost", "tie_weights"]


def tie_weights(graph, strategy: Strategy, *, modules: dict, ev, notes: list) -> Strategy:
    """Each tied layer and its holder on one weight layout: kept when the tied layer's
    strategy (same mesh, input and output) accepts the holder's, else both re-chosen as the
    pair of least time near them over the layouts both accept (docs/auto.md, 'Tied
    weights'). Across pipeline stages the same holds: each stage keeps a copy of the weight,
    laid out alike (same mesh shape and layout; `sbpflow.parallel.tie`)."""
    layers = list(strategy.layers)
    for user, holder in graph.ties.items():
        i, h = graph.index[user], graph.index[holder]
        su, sh = layers[i], layers[h]
        weighted = dataclasses.replace(graph.layers[i], tied=None, weight_shape=graph_weight_shape(
            graph.layers[i].kind, modules[user]))
        held = MeshLayout(sh.mesh, module_nd(graph.layers[h], sh.weight))
        if _accepts(weighted, su, held):
            continue
        mine = _weight_options(ev, graph, layers, j=i, weighted=weighted,
                               stage=getattr(su, "stage", 0))
        theirs = _weight_options(ev, graph, layers, j=h, weighted=graph.layers[h],
                                 stage=getattr(sh, "stage", 0))
        both = [k for k in theirs if k in mine]
        if not both:
            raise ParallelizeError(f"parallelize: layers {holder} (stage "
                                   f"{getattr(sh, 'stage', 0)}) and {user} (stage "
                                   f"{getattr(su, 'stage', 0)}) share a weight (tied) but no "
                                   f"mesh and layout of it suits both; untie the weight or "
                                   f"give them meshes of one shape")
        key = min(both, key=lambda k: theirs[k][0] + mine[k][0])
        layers[h], layers[i] = theirs[key][1], mine[key][1]
        notes.append(f"{user} uses the weight of {holder} (tied): the weight laid out as "
                     f"{key} for both ({holder} "
                     f"{layers[h].label or layers[h]}, {user} {layers[i].label or layers[i]})")
    if layers == strategy.layers:
        return strategy
    return restrategy(graph, layers, strategy)


def near_cost(ev, graph, layers: list, *, j: int, c) -> float:
    """Layer ``j``'s node time under ``c`` plus its edges' times, the other layers fixed."""
    layer = graph.layers[j]
    t = ev.node_terms(layer, c)["time"]
    for u in graph.preds[j]:
        t += ev.edge_terms(graph.layers[u], layers[u], layer, c)["time"]
    for w in graph.succs[j]:
        t += ev.edge_terms(layer, c, graph.layers[w], layers[w])["time"]
    return t


def _weight_options(ev, graph, layers: list, *, j: int, weighted, stage: int) -> dict:
    """``{MeshLayout of the weight in the module's axes: (time near layer j, its strategy)}``,
    the cheapest strategy of layer ``j`` per weight layout; ``weighted`` is the layer with its
    weight (a tied layer's strategies are priced without it: the holder carries the weight)."""
    layer = graph.layers[j]
    out: dict = {}
    for c in layer_space(weighted, layers[j].devices):
        s = dataclasses.replace(c, stage=stage)
        if layer.weight_shape is None:
            s = dataclasses.replace(s, weight=None, stored=None)
        key = MeshLayout(c.mesh, module_nd(layer, c.weight))
        t = near_cost(ev, graph, layers, j=j, c=s)
        if key not in out or t < out[key][0]:
            out[key] = (t, s)
    return out


def _accepts(weighted, s, held: MeshLayout) -> bool:
    """Whether tied layer strategy ``s`` (same mesh, input and output) runs with the weight
    laid out as ``held`` (its MeshLayout in the module's axes)."""
    if s.mesh != held.mesh:
        return False
    if s.weight is not None:
        return module_nd(weighted, s.weight) == held.sbp
    return any((c.input, c.output) == (s.input, s.output) and
               module_nd(weighted, c.weight) == held.sbp
               for c in layer_space(weighted, s.devices) if c.mesh == s.mesh)
