"""``sf.auto.parallelize``: search (or take) a strategy for an ``sf.nn`` model and make the model
run with it.

    plan = sf.auto.parallelize(model, (tokens, positions, targets), placement, cluster)
    x = plan.input(torch_batch)          # replicated onto plan.placement (any layout works)
    loss = model(x, ...); loss.backward(); opt.step()   # build the optimizer after parallelize

What it does:

1. `trace` the model: its Linear / Embedding calls in order, as a chain `Graph`.
2. Search a strategy on ``placement.size`` devices, or take ``strategy`` (a `Strategy` of that
   graph, or a ``{layer name: LayerStrategy}`` dict). All layers must share one mesh, because
   the weightless ops between layers (residual adds, norms, attention) need their inputs on one
   placement. The search therefore runs once per mesh with every layer restricted to it (exact
   dynamic programming over the chain by default) and keeps the best. A given strategy whose
   layers use several meshes is moved onto the mesh most of its layers use: each other layer
   takes its cheapest strategy on that mesh with the rest fixed (``plan.notes`` says which).
3. ``placement`` is reshaped to the mesh (its ranks in row-major order); every parameter is
   boxed onto it: a traced layer's weight to the strategy's weight nd-sbp (axes swapped for a
   Linear, whose weight is ``(out, in)`` where the graph's is ``(in, out)``), its bias following
   the weight's output axis; everything else (norms, untraced modules) replicated.
4. Each traced module's forward is wrapped: the activation is boxed to the layer's input layout
   (after moving it onto the placement if it lives elsewhere), the module runs, and its output
   is boxed to the layer's output layout (a no-op when the op's signature already gives it).
   The graph's token axis 0 is the activation's axis 0 (batch), its feature axis the last.

ZeRO-style ``stored`` weight layouts are not applied (the parameter takes the kernel layout).
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from dataclasses import dataclass, field

from ..sbp import B, Broadcast, S, Split
from .evaluate import Breakdown, Evaluator
from .space import LayerStrategy, Strategy, layer_space, meshes
from .trace import trace

__all__ = ["parallelize", "ParallelPlan", "single_mesh_search"]


@dataclass
class ParallelPlan:
    """What `parallelize` did: the traced graph, the strategy run, the placement (reshaped to
    the strategy's mesh), its predicted breakdown and notes."""

    graph: object
    strategy: Strategy
    placement: object
    breakdown: Breakdown | None
    modules: dict
    notes: list = field(default_factory=list)
    search_seconds: float = 0.0

    def input(self, value, sbp=None):
        """A torch tensor (the same on every rank) as a global tensor on ``self.placement``
        (replicated unless ``sbp`` is given); a global tensor is boxed there."""
        import torch
        from ..tensor import tensor as _sf_tensor
        sbp = sbp if sbp is not None else (B,) * self.placement.ndim
        if isinstance(value, torch.Tensor):
            return _sf_tensor(value, self.placement, sbp)
        return value.to_global(placement=self.placement, sbp=sbp)

    def __str__(self) -> str:
        head = f"parallelize: mesh {tuple(self.placement.shape)} ({self.placement})"
        notes = "".join(f"\nnote: {n}" for n in self.notes)
        return f"{head}{notes}\n{self.strategy.table()}"


# -- layouts: graph axes -> module axes ---------------------------------------------------------------
def _swap01(nd):
    return tuple(S(1 - s.axis) if isinstance(s, Split) else s for s in nd)


def _bias_of(weight_nd):
    """The bias follows a (out, in) weight's output axis 0; replicated where split on axis 1."""
    return tuple(s if not isinstance(s, Split) else (s if s.axis == 0 else Broadcast())
                 for s in weight_nd)


def _act(nd, ndim):
    """Graph activation (tokens, features) -> a tensor with ``ndim`` axes: tokens on axis 0,
    features on the last axis."""
    out = []
    for s in nd:
        if isinstance(s, Split):
            out.append(S(0) if s.axis == 0 else S(ndim - 1))
        else:
            out.append(s)
    return tuple(out)


# -- single-mesh search ---------------------------------------------------------------------------
def single_mesh_search(graph, cluster, algorithm: str = "exhaustive", seed: int = 0,
                       memory_limit: float | None = None, max_dims: int = 3, **options):
    """The best strategy whose layers all share one mesh: the search restricted to each mesh
    of ``cluster.world_size`` devices in turn. Returns ``(strategy, breakdown, cost)``."""
    from .search import ALGORITHMS, Problem
    if memory_limit is None:
        memory_limit = getattr(cluster, "memory_per_device", None)
    if memory_limit is not None and math.isinf(memory_limit):
        memory_limit = None
    p = cluster.world_size
    best = None
    for mesh in meshes(p, max_dims):
        spaces = {}
        for l in graph.layers:
            c = [s for s in layer_space(l, p, max_dims) if s.mesh == mesh]
            if not c:
                break
            spaces[l.name] = c
        else:
            pb = Problem(graph, cluster, memory_limit, 1, max_dims, False, spaces)
            state, cost = ALGORITHMS[algorithm](pb, random.Random(seed), None,
                                                time.perf_counter(), [], **options)
            if best is None or cost < best[2]:
                best = (pb.strategy(state), pb, cost)
    if best is None:
        raise ValueError(f"no mesh of {p} devices fits every layer of {graph.name}")
    strategy, pb, cost = best
    return strategy, pb.ev.breakdown(strategy), cost


def _to_one_mesh(graph, strategy: Strategy, cluster, notes: list) -> Strategy:
    """Move every layer onto the mesh most layers use (cheapest strategy there, others fixed)."""
    counts = Counter(s.mesh for s in strategy.layers)
    mesh = max(counts, key=lambda m: (counts[m], -strategy.layers.index(
        next(s for s in strategy.layers if s.mesh == m))))
    if len(counts) == 1:
        return strategy
    layers = list(strategy.layers)
    ev = Evaluator(graph, cluster) if cluster is not None else None
    p = math.prod(mesh)
    moved = []
    for i, (l, s) in enumerate(zip(graph.layers, layers)):
        if s.mesh == mesh:
            continue
        cands = [c for c in layer_space(l, p) if c.mesh == mesh]
        if not cands:
            raise ValueError(f"layer {l.name}: no strategy on mesh {mesh}")

        def cost(c):
            if ev is None:
                return 0.0
            t = ev.node_terms(l, c)["time"]
            for u in graph.preds[i]:
                t += ev.edge_terms(graph.layers[u], layers[u], l, c)["time"]
            for w in graph.succs[i]:
                t += ev.edge_terms(l, c, graph.layers[w], layers[w])["time"]
            return t
        layers[i] = min(cands, key=cost)
        moved.append(f"{l.name} {s.mesh}->{layers[i].label or layers[i]}")
    notes.append(f"layers use meshes {dict(counts)}; all moved to the majority mesh {mesh} "
                 f"({', '.join(moved)})")
    return Strategy(graph, layers)


# -- apply --------------------------------------------------------------------------------------------
def _wrap(module, kind, s: LayerStrategy, pl):
    orig = type(module).forward.__get__(module)   # the class's: parallelizing again replaces

    def forward(x, *rest, **kw):
        if x.placement != pl:
            x = x.to_global(placement=pl, sbp=(B,) * pl.ndim)
        if kind == "embedding":
            nd = tuple(S(0) if isinstance(t, Split) else t for t in s.input)
        else:
            nd = _act(s.input, x.ndim)
        x = x.to_global(sbp=nd)
        y = orig(x, *rest, **kw)
        return y.to_global(sbp=_act(s.output, y.ndim))
    object.__setattr__(module, "forward", forward)


def parallelize(model, example_inputs, placement, cluster=None, strategy=None, *,
                algorithm: str = "exhaustive", seed: int = 0, memory_limit=None) -> ParallelPlan:
    """Trace ``model`` on ``example_inputs``, search a strategy for ``placement.size`` devices on
    ``cluster`` (default: a single node of ``dgx-a100`` links with that many devices) or take
    ``strategy``, and lay the model out for it (in place). Every rank calls it; build the
    optimizer afterwards. Returns a `ParallelPlan` (also ``model.auto_plan``)."""
    from ..cost import Cluster
    from ..parallel.apply import apply as _apply

    p = placement.size
    if cluster is None:
        cluster = Cluster.preset("dgx-a100", nodes=1, devices_per_node=p)
    if cluster.world_size != p:
        raise ValueError(f"parallelize: cluster has {cluster.world_size} devices, placement "
                         f"{placement} has {p}")
    graph, modules = trace(model, example_inputs)
    notes: list = []
    t0 = time.perf_counter()
    if strategy is None:
        strategy, bd, _ = single_mesh_search(graph, cluster, algorithm, seed, memory_limit)
    else:
        if isinstance(strategy, dict):
            strategy = Strategy(graph, strategy)
        elif not isinstance(strategy, Strategy):
            strategy = Strategy(graph, list(strategy))
        elif strategy.graph is not graph:
            strategy = Strategy(graph, list(strategy.layers))
        if len(strategy.layers) != len(graph.layers):
            raise ValueError(f"parallelize: strategy has {len(strategy.layers)} layers, the "
                             f"traced graph {len(graph.layers)}")
        strategy = _to_one_mesh(graph, strategy, cluster, notes)
        bd = Evaluator(graph, cluster).breakdown(strategy)
    seconds = time.perf_counter() - t0
    if any(s.stored is not None and s.stored != s.weight for s in strategy.layers):
        notes.append("ZeRO 'stored' layouts are not applied: weights are kept in their kernel "
                     "layout")
    mesh = strategy.layers[0].mesh
    pl = placement.reshape(*mesh) if tuple(placement.shape) != tuple(mesh) else placement
    # parameter layouts by exact name
    rules: dict = {}
    for layer, s in zip(graph.layers, strategy.layers):
        m = modules[layer.name]
        prefix = f"{layer.name}." if layer.name else ""
        if layer.kind == "linear":
            w = _swap01(s.weight)
            rules[prefix + "weight"] = w
            if getattr(m, "bias", None) is not None:
                rules[prefix + "bias"] = _bias_of(w)
        else:
            rules[prefix + "weight"] = tuple(s.weight)
    rules = {_escape(k): v for k, v in rules.items()}
    rules["*"] = (B,) * pl.ndim
    _apply(model, pl, rules)
    for layer, s in zip(graph.layers, strategy.layers):
        _wrap(modules[layer.name], layer.kind, s, pl)
    plan = ParallelPlan(graph, strategy, pl, bd, modules, notes, seconds)
    object.__setattr__(model, "auto_plan", plan)
    return plan


def _escape(name: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)
