"""``sf.auto.parallelize``: search (or take) a strategy for an ``sf.nn`` model and make the model
run with it, each layer on its own mesh.

    plan = sf.auto.parallelize(model, (tokens, positions, targets), placement, cluster)
    x = plan.input(torch_batch)          # replicated onto plan.placement (any layout works)
    loss = model(x, ...); loss.backward(); opt.step()   # build the optimizer after parallelize

It traces the model (`trace`), searches or takes a strategy, puts a tied weight's users on one
layout, lays each layer's parameters out on its mesh's placement (`sf.parallel.relayout`), cuts
a pipelined strategy into stages (`sf.parallel.pipeline`) and wraps each traced module's forward
so that activations live between layers on one *stream placement* a stage, the common
refinement of its layer meshes. See docs/auto.md, 'Laying out a model' and 'Tied weights and
pipelined strategies'.
"""

from __future__ import annotations

import dataclasses
import math
import random
import sys
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field

from ..errors import GraphError, ParallelizeError, TraceError
from ..nn.modules import Module, ModuleDict, ModuleList, Sequential
from ..nn.recompute import checkpoint as _checkpoint
from ..nn.torch_modules import from_torch, is_torch_module
from ..parallel.pipeline import pipeline as _pipeline
from ..parallel.tie import install_views, tie_placement
from ..parallel.relayout import relayout
from ..parallel.zero import shard as _zero_shard
from ..placement import Placement
from ..sbp import B, Broadcast, S, Split, format_nd_sbp, shard_box
from ..tensor import recording
from .checks import MemoryLimitWarning
from .evaluate import Breakdown, Evaluator
from .space import LayerStrategy, Strategy, layer_space, meshes, zero_twin
from .trace import graph_weight_shape, trace

__all__ = ["parallelize", "ParallelPlan", "single_mesh_search", "ParallelizeError",
           "common_refinement"]


@dataclass
class ParallelPlan:
    """What `parallelize` did: the traced graph, the strategy run, the stream placement the
    activations live on between layers (``placement``: stage 0's for a pipeline, where the
    inputs go; docs/auto.md, 'Laying out a model'), each layer's placement, its predicted
    breakdown and notes. A pipelined strategy adds ``stages`` (each stage's stream
    placement) and ``pipeline`` (the `sf.parallel.pipeline` record); ``micro_batches`` and
    ``schedule`` are how to run the step (`configure`, `graph_step`)."""

    graph: object
    strategy: Strategy
    placement: object
    breakdown: Breakdown | None
    modules: dict
    notes: list = field(default_factory=list)
    search_seconds: float = 0.0
    placements: dict = field(default_factory=dict)
    model: object = None   # the model to call (a torch model's sbpflow conversion)
    stages: list = field(default_factory=list)
    pipeline: object = None
    micro_batches: int = 1
    schedule: str = "1f1b"

    def input(self, value, sbp=None):
        """A torch tensor (the same on every rank) as a global tensor on ``self.placement``
        (replicated unless ``sbp`` is given); a global tensor is boxed there."""
        import torch
        from ..tensor import tensor as _sf_tensor
        sbp = sbp if sbp is not None else (B,) * self.placement.ndim
        if isinstance(value, torch.Tensor):
            return _sf_tensor(value, self.placement, sbp)
        return value.to_global(placement=self.placement, sbp=sbp)

    def configure(self, graph):
        """Set an ``sf.nn.Graph``'s config to run this plan's step: the strategy's
        micro-batches as gradient accumulation steps, its pipeline schedule. Returns
        ``graph``. A plan with recomputing layers raises `GraphError` (a graph does not run
        activation checkpointing; docs/auto.md, 'Laying out a model')."""
        rc = [l.name for l, s in zip(self.graph.layers, self.strategy.layers) if s.recompute]
        if rc:
            raise GraphError(_graph_refusal(rc))
        graph.config.set_gradient_accumulation_steps(self.micro_batches)
        graph.config.set_pipeline_schedule(self.schedule)
        return graph

    def graph_step(self, optimizer, loss_fn=None):
        """An ``sf.nn.Graph`` whose call is one training step of ``self.model``: ``build(*inputs)``
        runs ``loss_fn(model, *inputs)`` (default ``model(*inputs)``, which must return the
        loss), ``loss.backward()``, then ``optimizer.step()`` and ``zero_grad()``; configured
        by `configure` (a pipeline's stages run overlapped on the actor runtime)."""
        from ..graph import Graph

        plan = self

        class AutoStep(Graph):
            def __init__(self):
                super().__init__()
                self.model = plan.model
                self.add_optimizer(optimizer)
                plan.configure(self)

            def build(self, *inputs):
                loss = self.model(*inputs) if loss_fn is None else loss_fn(self.model, *inputs)
                loss.backward()
                return loss
        return AutoStep()

    def __str__(self) -> str:
        head = f"parallelize: stream mesh {tuple(self.placement.shape)} ({self.placement})"
        if self.stages:
            head += (f"; {len(self.stages)} pipeline stages on "
                     f"{', '.join(str(pl) for pl in self.stages)}, {self.micro_batches} "
                     f"micro-batches {self.schedule}")
        layer_meshes = Counter(tuple(pl.shape) for pl in self.placements.values())
        if layer_meshes:
            head += f"; layer meshes {dict(layer_meshes)}"
        notes = "".join(f"\nnote: {n}" for n in self.notes)
        return f"{head}{notes}\n{self.strategy.table()}"


# -- layouts: graph axes -> module axes ---------------------------------------------------------------
def _swap01(nd):
    return tuple(S(1 - s.axis) if isinstance(s, Split) else s for s in nd)


def _bias_of(weight_nd, out_axis: int = 0):
    """The bias follows the weight's output axis (0 of an ``(out, ...)`` weight, 1 of a
    `stores_in_out` module's ``(in, out)``); replicated where the weight is split elsewhere."""
    return tuple(s if not isinstance(s, Split) else (S(0) if s.axis == out_axis else Broadcast())
                 for s in weight_nd)


def _out_axis(layer) -> int:
    """The output axis of ``layer``'s module weight (`_bias_of`)."""
    return 1 if layer.attrs.get("weight_in_out") else 0


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


def _conv_act(nd, ndim):
    """Graph conv activation (N, C, H, W) -> an unbatched (C, H, W) tensor drops axis N."""
    if ndim == 4:
        return tuple(nd)
    return tuple(B if isinstance(s, Split) and s.axis == 0 else
                 (S(s.axis - 1) if isinstance(s, Split) else s) for s in nd)


def _module_layout(kind, nd, ndim):
    if kind == "embedding":
        return tuple(S(0) if isinstance(t, Split) else t for t in nd)
    if kind == "conv":
        return _conv_act(nd, ndim)
    return _act(nd, ndim)


# -- meshes and their common refinement -----------------------------------------------------------
def _cuts(mesh) -> set:
    """Row-major block sizes of a mesh: prod(mesh[i:]) for every i."""
    return {math.prod(mesh[i:]) for i in range(len(mesh))}


def common_refinement(mesh_list) -> tuple | None:
    """The coarsest mesh (over the same ranks, row-major) that refines every mesh of
    ``mesh_list``: each of their dims is a run of its dims. None if there is none (e.g.
    ``(3, 4)`` and ``(4, 3)``). ``(4,), (2, 2)`` -> ``(2, 2)``; ``(2, 4), (4, 2)`` ->
    ``(2, 2, 2)``."""
    mesh_list = [tuple(m) for m in mesh_list]
    sizes = {math.prod(m) for m in mesh_list}
    if len(sizes) != 1:
        raise ParallelizeError(f"meshes {mesh_list} have different device counts {sorted(sizes)}")
    cuts = sorted(set().union(*(_cuts(m) for m in mesh_list)) | {1})
    if any(b % a for a, b in zip(cuts, cuts[1:])):
        return None
    inner = [b // a for a, b in zip(cuts, cuts[1:])]
    fine = tuple(reversed([f for f in inner if f != 1]))
    return fine or (1,)


def _owner(coarse: tuple, fine: tuple) -> tuple | None:
    """For each dim of ``fine``, the dim of ``coarse`` it is part of; None if ``fine`` does not
    refine ``coarse``."""
    if math.prod(coarse) != math.prod(fine) or not _cuts(coarse) <= _cuts(fine) | {1}:
        return None
    # the innermost coarse dim whose block still holds fine dim j's block (a size-1 dim,
    # of either mesh, may go with any: the innermost is taken, so a (1,) mesh has an owner)
    return tuple(max(i for i in range(len(coarse)) if math.prod(fine[j:]) <= math.prod(coarse[i:]))
                 for j in range(len(fine)))


class _ActivationPlacement:
    """The placement activations live on between layers, and moves to and from layer
    placements (relabels where the layouts hold the same elements on every rank)."""

    def __init__(self, placement, owners: dict):
        self.placement = placement
        self.owners = owners           # layer mesh -> owner map into the stream mesh, or None
        self._same: dict = {}

    def image(self, mesh, nd) -> tuple | None:
        owner = self.owners.get(tuple(mesh))
        return None if owner is None else tuple(nd[i] for i in owner)

    def _same_shards(self, shape, src_pl, src_nd, dst_pl, dst_nd) -> bool:
        key = (shape, src_pl, src_nd, dst_pl, dst_nd)
        hit = self._same.get(key)
        if hit is None:
            if len(self._same) > 4096:
                self._same.clear()
            hit = self._same[key] = all(
                shard_box(shape, src_pl.shape, src_nd, src_pl.coord_of(r)) ==
                shard_box(shape, dst_pl.shape, dst_nd, dst_pl.coord_of(r))
                for r in src_pl.flat_ranks)
        return hit

    def relabel(self, x, pl, nd):
        """``x`` as the same logical tensor on ``pl`` (same ranks, another mesh) with ``nd``,
        whose image is ``x``'s layout: the shards are reused (no communication, autograd
        flows through them) when every rank holds the same region, else boxed."""
        from ..tensor import from_local
        if x.placement == pl and tuple(x.sbp) == tuple(nd):
            return x
        shape = tuple(x.shape)
        if sorted(x.placement.flat_ranks) == sorted(pl.flat_ranks) and \
                self._same_shards(shape, x.placement, tuple(x.sbp), pl, tuple(nd)):
            return from_local(x.local, placement=pl, sbp=nd, shape=shape)
        return x.to_global(placement=pl, sbp=nd)

    def enter(self, x, pl, nd):
        """Box activation ``x`` to layout ``nd`` on layer placement ``pl``."""
        img = self.image(pl.shape, nd)
        if img is None:
            return x.to_global(placement=pl, sbp=nd)
        x = x.to_global(placement=self.placement, sbp=img)   # the redistribution
        return self.relabel(x, pl, nd)

    def leave(self, y):
        """Layer output ``y`` (on its layer placement) onto the stream."""
        if y.placement == self.placement:
            return y
        img = self.image(y.placement.shape, y.sbp)
        if img is None:
            return y.to_global(placement=self.placement, sbp=(B,) * self.placement.ndim)
        return self.relabel(y, self.placement, img)


# -- single-mesh search ---------------------------------------------------------------------------
def single_mesh_search(graph, cluster, algorithm: str = "exhaustive", seed: int = 0,
                       memory_limit: float | None = None, max_dims: int = 3,
                       recompute: bool = False, zero=False, **options):
    """The best strategy whose layers all share one mesh: the search restricted to each mesh
    of ``cluster.world_size`` devices in turn (recomputing twins too with ``recompute``,
    ZeRO twins with ``zero``, as `layer_space`). Returns ``(strategy, breakdown, cost)``."""
    from .strategy_search import ALGORITHMS, Problem, check_memory_limit
    check_memory_limit(memory_limit)
    if memory_limit is None:
        memory_limit = getattr(cluster, "memory_per_device", None)
    if memory_limit is not None and math.isinf(memory_limit):
        memory_limit = None
    p = cluster.world_size
    best = None
    for mesh in meshes(p, max_dims):
        spaces = {}
        for l in graph.layers:
            c = [s for s in layer_space(l, p, max_dims, zero, recompute) if s.mesh == mesh]
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
        layers[i] = zero_twin(l, min(cands, key=cost), s.zero)   # keeps the layer's stage
        moved.append(f"{l.name} {s.mesh}->{layers[i].label or layers[i]}")
    notes.append(f"layers use meshes {dict(counts)}; all moved to the majority mesh {mesh} "
                 f"({', '.join(moved)})")
    return Strategy(graph, layers)


# -- tied weights ----------------------------------------------------------------------------------
def _module_nd(layer, nd) -> tuple:
    """A layer's weight layout in its module's axes (a Linear's weight is ``(out, in)``, a
    `stores_in_out` module's ``(in, out)`` as the graph's)."""
    if layer.kind == "linear" and not layer.attrs.get("weight_in_out"):
        return _swap01(nd)
    return tuple(nd)


def _near_cost(ev, graph, layers: list, j: int, c) -> float:
    """Layer ``j``'s node time under ``c`` plus its edges' times, the other layers fixed."""
    layer = graph.layers[j]
    t = ev.node_terms(layer, c)["time"]
    for u in graph.preds[j]:
        t += ev.edge_terms(graph.layers[u], layers[u], layer, c)["time"]
    for w in graph.succs[j]:
        t += ev.edge_terms(layer, c, graph.layers[w], layers[w])["time"]
    return t


def _weight_options(ev, graph, layers: list, j: int, weighted, stage: int) -> dict:
    """``{(mesh, module weight nd-sbp): (time near layer j, its strategy)}``, the cheapest
    strategy of layer ``j`` per weight layout; ``weighted`` is the layer with its weight (a
    tied layer's strategies are priced without it: the holder carries the weight)."""
    layer = graph.layers[j]
    out: dict = {}
    for c in layer_space(weighted, layers[j].devices):
        s = dataclasses.replace(c, stage=stage)
        if layer.weight_shape is None:
            s = dataclasses.replace(s, weight=None, stored=None)
        key = (c.mesh, _module_nd(layer, c.weight))
        t = _near_cost(ev, graph, layers, j, s)
        if key not in out or t < out[key][0]:
            out[key] = (t, s)
    return out


def _accepts(weighted, s, held: tuple) -> bool:
    """Whether tied layer strategy ``s`` (same mesh, input and output) runs with the weight
    laid out as ``held`` = (mesh, module nd-sbp)."""
    if s.mesh != held[0]:
        return False
    if s.weight is not None:
        return _module_nd(weighted, s.weight) == held[1]
    return any((c.input, c.output) == (s.input, s.output) and
               _module_nd(weighted, c.weight) == held[1]
               for c in layer_space(weighted, s.devices) if c.mesh == s.mesh)


def _tie_weights(graph, strategy: Strategy, modules: dict, ev, notes: list) -> Strategy:
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
        held = (sh.mesh, _module_nd(graph.layers[h], sh.weight))
        if _accepts(weighted, su, held):
            continue
        mine = _weight_options(ev, graph, layers, i, weighted, getattr(su, "stage", 0))
        theirs = _weight_options(ev, graph, layers, h, graph.layers[h], getattr(sh, "stage", 0))
        both = [k for k in theirs if k in mine]
        if not both:
            raise ParallelizeError(f"parallelize: layers {holder} (stage "
                                   f"{getattr(sh, 'stage', 0)}) and {user} (stage "
                                   f"{getattr(su, 'stage', 0)}) share a weight (tied) but no "
                                   f"mesh and layout of it suits both; untie the weight or "
                                   f"give them meshes of one shape")
        key = min(both, key=lambda k: theirs[k][0] + mine[k][0])
        layers[h], layers[i] = theirs[key][1], mine[key][1]
        notes.append(f"{user} uses the weight of {holder} (tied): both laid out with mesh "
                     f"{key[0]}, weight {format_nd_sbp(key[1])} ({holder} "
                     f"{layers[h].label or layers[h]}, {user} {layers[i].label or layers[i]})")
    if layers == strategy.layers:
        return strategy
    return _restrategy(graph, layers, strategy)


def _restrategy(graph, layers: list, like) -> Strategy:
    """A `Strategy` of ``graph`` with ``layers`` and the pipeline of strategy ``like``."""
    pp = getattr(like, "pipeline", None)
    return Strategy(graph, layers, *([pp] if pp is not None else []))


# -- apply --------------------------------------------------------------------------------------------
def _wrap(module, kind, s: LayerStrategy, pl, stream: _ActivationPlacement, name: str,
          alone: bool = False) -> None:
    """Replace ``module``'s forward: input boxed from the stream to the layer's layout, the
    module's own forward, output boxed to the layer's layout and back onto the stream.
    ``alone``: the layer is a recomputation region of its own (`_recompute_regions`) and
    runs its forward and output boxing under `sf.nn.checkpoint`."""
    orig = type(module).forward.__get__(module)   # the class's: parallelizing again replaces

    def run(x, *rest, **kw):
        y = orig(x, *rest, **kw)
        out = _conv_act(s.output, y.ndim) if kind == "conv" else _act(s.output, y.ndim)
        return y.to_global(sbp=out)

    def forward(x, *rest, **kw):
        x = stream.enter(x, pl, _module_layout(kind, s.input, x.ndim))
        if not alone:
            return stream.leave(run(x, *rest, **kw))
        if recording():
            raise GraphError(_graph_refusal([name]))
        return stream.leave(_checkpoint(run, x, *rest, **kw))
    object.__setattr__(module, "forward", forward)


def _recompute_regions(model, graph, strategy) -> list:
    """The module names run under `sf.nn.checkpoint` for the recomputing layers
    (``LayerStrategy.recompute``): for each, the outermost called module (not a ModuleList
    or ModuleDict, not the model) whose traced layers all recompute, in one stage (a GPT
    block whose layers all recompute is one region, its norms and attention recomputed
    too); else the layer's own module."""
    names = [l.name for l in graph.layers]
    rc = [s.recompute for s in strategy.layers]
    stage = [getattr(s, "stage", 0) for s in strategy.layers]
    out, covered = [], set()
    for i, n in enumerate(names):
        if not rc[i] or i in covered:
            continue
        for p in _prefixes(n):
            under = _under(names, p)
            if p == n or (not isinstance(model.get_submodule(p), (ModuleList, ModuleDict)) and
                          all(rc[j] and stage[j] == stage[i] for j in under)):
                out.append(p)
                covered.update(under)
                break
    return out


def _checkpoint_module(module, name: str) -> None:
    """Run ``module``'s (class) forward under `sf.nn.checkpoint`; refused in a graph."""
    orig = type(module).forward.__get__(module)

    def forward(*args, **kw):
        if recording():
            raise GraphError(_graph_refusal([name]))
        return _checkpoint(orig, *args, **kw)
    forward.sf_recompute = True   # undone by the next `parallelize`
    object.__setattr__(module, "forward", forward)


def _graph_refusal(names: list) -> str:
    """Why a recomputing plan does not run as an ``sf.nn.Graph``, and the fix."""
    return (f"parallelize: layers {names} recompute their forward in backward (strategy "
            f"'+rc', LayerStrategy.recompute=True), and a graph does not run activation "
            f"checkpointing yet (it would keep the activations). Run the step eagerly "
            f"(model(...); loss.backward(); opt.step()), or search without recomputation "
            f"(parallelize(..., recompute=False), the default) / give a strategy whose "
            f"layers have recompute=False")


def _layouts(graph, strategy, modules, placements) -> dict:
    """id(parameter) -> (placement, nd-sbp, name of the layer) for every traced layer's
    parameters (a tied layer's weight is its holder's; its bias follows that weight); a
    parameter shared by layers with different layouts raises."""
    out: dict = {}
    for layer, s in zip(graph.layers, strategy.layers):
        m = modules[layer.name]
        pl = placements[layer.name]
        if layer.tied is not None:
            hl = graph[layer.tied]
            w, out_axis = _module_nd(hl, strategy[layer.tied].weight), _out_axis(hl)
            want = []
        else:
            w, out_axis = _module_nd(layer, s.weight), _out_axis(layer)
            want = [(m.weight, w)]
        if getattr(m, "bias", None) is not None:
            want.append((m.bias, _bias_of(w, out_axis)))
        for p, nd in want:
            prev = out.get(id(p))
            if prev is not None and (prev[0] != pl or prev[1] != nd):
                raise ParallelizeError(
                    f"parallelize: a parameter of shape {tuple(p.shape)} is shared by layers "
                    f"{prev[2]} (on {prev[0]} with sbp {format_nd_sbp(prev[1])}) and "
                    f"{layer.name} (on {pl} with sbp {format_nd_sbp(nd)}); give a strategy in "
                    f"which they lay it out alike")
            out[id(p)] = (pl, nd, layer.name)
    for user, holder in graph.ties.items():   # across stages: one copy a stage
        su, sh = strategy[user], strategy[holder]
        if getattr(su, "stage", 0) != getattr(sh, "stage", 0):
            w = modules[holder].weight
            pl, nd = tie_placement(f"the weight of {holder} and {user}",
                                   [placements[holder], placements[user]],
                                   [out[id(w)][1]] * 2, "parallelize")
            out[id(w)] = (pl, nd, holder)
    return out


def _tie_views(graph, strategy, modules, placements) -> None:
    """The users of a weight tied across stages read it through their stage's view."""
    for user, holder in graph.ties.items():
        if getattr(strategy[user], "stage", 0) != getattr(strategy[holder], "stage", 0):
            install_views(modules[holder].weight,
                          [(modules[n], "weight", placements[n]) for n in (holder, user)])


def parallelize(model, example_inputs, placement, cluster=None, strategy=None, *,
                algorithm: str = "exhaustive", seed: int = 0, memory_limit=None,
                one_mesh: bool = False, stages=1, recompute: bool = False,
                zero: bool | int | tuple = False, meta: bool | str = "auto") -> ParallelPlan:
    """Trace ``model`` on ``example_inputs`` (`trace`: ``meta="auto"``, the default, on
    shapes, and with the real forward where that needs a value the weights compute, noted;
    ``True`` shapes only; ``False`` the real forward), search a strategy for
    ``placement.size`` devices on ``cluster`` (default: a single node of ``dgx-a100`` links
    with that many devices) or take ``strategy``, and lay the model out for it, in place: each
    layer on its strategy's mesh, activations on the stream placement between layers
    (docs/auto.md, 'Laying out a model'). Every rank calls it, with the same arguments; build
    the optimizer afterwards. ``one_mesh=True`` keeps every layer on one mesh; ``stages``
    (1, a count, ``"auto"`` or ``"search"``, as `sf.auto.search`) lets the search cut the
    model into pipeline stages, which a
    given strategy may have too (run them with `ParallelPlan.graph_step`). ``recompute=True``
    lets the search choose per-layer activation recomputation, which runs eagerly under
    `sf.nn.checkpoint` (a given strategy's ``LayerStrategy.recompute`` too), not as a graph
    (`ParallelPlan.configure` raises `GraphError`). ``zero`` (as `sf.auto.search`: True adds
    each layer's ZeRO-3 twins to the space) lets the search store weights split; each layer
    runs its strategy's ZeRO stage (``LayerStrategy.zero``: 1, 2 or 3, as
    ``sf.parallel.apply(..., zero=)``). A tied weight
    gets one layout (docs/auto.md, 'Tied weights and pipelined strategies'). Returns a
    `ParallelPlan` (also ``model.auto_plan``); a plain ``torch.nn.Module`` is converted first
    (`sf.nn.from_torch`) and the plan's ``model`` is the model to call."""
    cluster = _checked_arguments(model, placement, cluster)
    if is_torch_module(model):
        model = from_torch(model, placement)
    notes = []
    graph, modules = _traced(model, example_inputs, meta, notes)
    t0 = time.perf_counter()
    if strategy is None:
        strategy, bd = _search(graph, cluster, algorithm, seed, memory_limit, one_mesh, stages,
                               notes, recompute, zero)
    else:
        strategy = _given(graph, strategy, placement)
        if one_mesh:
            if getattr(strategy, "pipeline", None) is not None:
                raise ParallelizeError("parallelize: one_mesh=True with a pipelined strategy; "
                                       "give one or the other")
            strategy = _to_one_mesh(graph, strategy, cluster, notes)
        bd = None
    snapped = _snap_cuts(model, graph, strategy, notes)
    tied = _tie_weights(graph, snapped, modules, _evaluator(graph, snapped, cluster), notes)
    if bd is None or tied is not strategy:
        bd = _breakdown(graph, tied, cluster)
    strategy = tied
    _note_memory(bd, memory_limit, cluster, notes, {"zero=True": zero, "recompute=True":
                                                     recompute, "stages='search'": stages ==
                                                     "search"})
    seconds = time.perf_counter() - t0
    plan = _lay_out(model, graph, strategy, modules, placement, notes)
    plan.breakdown, plan.search_seconds, plan.model = bd, seconds, model
    pp = getattr(strategy, "pipeline", None)
    plan.micro_batches = pp.micro_batches if pp is not None else \
        (bd.micro_batches if bd is not None else 1)
    plan.schedule = pp.schedule if pp is not None else "1f1b"
    object.__setattr__(model, "auto_plan", plan)
    return plan


def _traced(model, example_inputs, meta, notes: list) -> tuple:
    """`trace` of ``model`` as ``meta`` asks (`parallelize`); ``"auto"`` falls back to the
    real forward (a collective: every rank calls `parallelize`, and every rank's trace on
    shapes fails alike) when the forward on shapes raises `TraceError`, and notes why."""
    if meta not in (True, False, "auto"):
        raise ParallelizeError(f"parallelize: meta must be True (trace on shapes), False (the "
                               f"real forward) or 'auto' (shapes, else the real forward), "
                               f"got {meta!r}")
    if meta is not False:
        example_inputs = _replicated(example_inputs)
    if meta != "auto":
        return trace(model, example_inputs, meta=meta)
    try:
        return trace(model, example_inputs)
    except TraceError as exc:
        cause = exc.__cause__ if exc.__cause__ is not None else exc
        notes.append(f"traced with the real forward (meta=False): on shapes it raised "
                     f"{type(cause).__name__}: {str(cause).splitlines()[0][:200]}")
        return trace(model, example_inputs, meta=False)


def _replicated(example_inputs):
    """``example_inputs`` (a tuple, a list, a dict or one value) with each global tensor that
    is not replicated boxed to replicated on its placement (a collective, on inputs: token
    ids, masks), so that the trace on shapes knows their values (a Hugging Face forward reads
    its ids and masks: ``pad_token_id in input_ids``, the causal mask's shortcuts)."""
    from ..tensor import GlobalTensor

    def one(a):
        if not isinstance(a, GlobalTensor) or all(isinstance(s, Broadcast) for s in a.sbp):
            return a
        return a.to_global(sbp=(B,) * a.placement.ndim)
    if isinstance(example_inputs, dict):
        return {k: one(v) for k, v in example_inputs.items()}
    if isinstance(example_inputs, (tuple, list)):
        return tuple(one(a) for a in example_inputs)
    return one(example_inputs)


def _note_memory(bd: Breakdown, limit, cluster, notes: list, options: dict) -> None:
    """Say (a note and a `MemoryLimitWarning`, a `RuntimeWarning`) when the strategy needs more memory a device than
    ``limit`` bytes (None: the cluster's): the model is laid out anyway (the search found
    nothing within it). ``options``: the search options that could help, and whether each
    was given (the advice names the others)."""
    from .strategy_search import check_memory_limit
    check_memory_limit(limit)
    limit = getattr(cluster, "memory_per_device", None) if limit is None else limit
    need = bd.memory.get("total", 0)
    if limit is None or math.isinf(limit) or need <= limit:
        return
    allow = [k for k, given in options.items() if not given]
    text = (f"the strategy needs {need / 2**30:.3g} GiB a device, over the memory limit of "
            f"{limit / 2**30:.3g} GiB (nothing searched fits it: "
            + (f"allow {', '.join(allow)}, or " if allow else "") + "use more devices)")
    notes.append(text)
    warnings.warn(f"sf.auto.parallelize: {text}", MemoryLimitWarning, stacklevel=3)


def _evaluator(graph, strategy, cluster):
    """An `Evaluator` of per-layer and per-edge prices (a pipeline's at its micro-batches:
    a stage's meshes cover its first ranks, priced on the cluster's links)."""
    pp = getattr(strategy, "pipeline", None)
    return Evaluator(graph, cluster, 1 if pp is None else pp.micro_batches)


def _package():
    """``sbpflow.auto``, whose ``evaluate`` takes pipeline stages (looked up
    there, not in their modules: those belong to the search and may move)."""
    return sys.modules[__package__]


def _breakdown(graph, strategy, cluster) -> Breakdown:
    """The predicted cost of ``strategy`` (``sf.auto.evaluate``, pipelines included)."""
    if getattr(strategy, "pipeline", None) is None:
        return Evaluator(graph, cluster).breakdown(strategy)
    return _package().evaluate(graph, strategy, cluster)


def _lay_out(model, graph, strategy, modules, placement, notes: list) -> ParallelPlan:
    """Lay the model out for ``strategy`` (stages, parameters, wrapped forwards): the plan
    without its breakdown."""
    groups = _stage_groups(graph, strategy, placement)
    placements, streams = {}, []
    for stage_pl, idx in groups:
        on = _placements_by_mesh(stage_pl)
        for i in idx:
            placements[graph.layers[i].name] = on(strategy.layers[i].mesh)
        streams.append(_stream([strategy.layers[i] for i in idx], on, notes))
    layouts = _layouts(graph, strategy, modules, placements)
    pipe = None
    if len(groups) > 1:   # stage placements for the untraced parameters, buffers, hooks
        pipe = _cut(model, graph, strategy, groups, [st.placement for st in streams],
                    set(layouts))
    replicated = (streams[0].placement, (B,) * streams[0].placement.ndim)
    relayout(model, lambda _, p: layouts[id(p)][:2] if id(p) in layouts else
             ((p.placement, p.sbp) if pipe is not None else replicated), "parallelize")
    if pipe is None:
        _move_buffers(model, streams[0].placement)
    _tie_views(graph, strategy, modules, placements)
    _zero_stages(model, graph, strategy, modules)
    for m in model.modules():   # recomputation regions of an earlier parallelize
        if getattr(m.__dict__.get("forward"), "sf_recompute", False):
            del m.__dict__["forward"]
    regions = _recompute_regions(model, graph, strategy)
    for k, (_, idx) in enumerate(groups):
        for i in idx:
            layer = graph.layers[i]
            _wrap(modules[layer.name], layer.kind, strategy.layers[i], placements[layer.name],
                  streams[k], layer.name, layer.name in regions)
    for name in regions:
        if name not in modules:
            _checkpoint_module(model.get_submodule(name), name)
    plan = ParallelPlan(graph, strategy, streams[0].placement, None, modules, notes, 0.0,
                        placements)
    if pipe is not None:
        plan.stages, plan.pipeline = [st.placement for st in streams], pipe
    return plan


def _move_buffers(model, placement) -> None:
    """Every buffer onto the stream ``placement`` of a one-stage plan, where the activations
    it meets live (a rotary embedding's frequencies): its nd-sbp kept on a mesh of as many
    dims, else replicated (a boxing; one moved tensor for a buffer registered twice). A
    pipeline moves its buffers itself (`sf.parallel.pipeline`)."""
    from ..tensor import GlobalTensor
    moved: dict = {}
    for m in model.modules():
        for key, b in list(m._buffers.items()):
            if not isinstance(b, GlobalTensor) or b.placement == placement:
                continue
            if id(b) not in moved:
                nd = b.sbp if b.placement.ndim == placement.ndim else (B,) * placement.ndim
                moved[id(b)] = b.to_global(placement=placement, sbp=nd)
            m._buffers[key] = moved[id(b)]


def _zero_stages(model, graph, strategy, modules) -> None:
    """Run each layer's ZeRO stage (``LayerStrategy.zero``) on its weight and bias, as
    ``sf.parallel.apply(..., zero=)`` does (`sbpflow.parallel.zero.shard`, split along their
    data-parallel dims). Stage 1 first: a later `shard` call gives the units its own
    parameters. Stages 2 and 3 in one model raise `ParallelizeError` (a unit gathers its
    parameters one way)."""
    ids: dict = {1: set(), 2: set(), 3: set()}
    names: dict = {1: [], 2: [], 3: []}
    for layer, s in zip(graph.layers, strategy.layers):
        if not s.zero or s.stored == s.weight:
            continue
        names[s.zero].append(layer.name)
        m = modules[layer.name]
        ids[s.zero].update(id(p) for p in (m.weight, getattr(m, "bias", None))
                           if p is not None)
    if names[2] and names[3]:
        raise ParallelizeError(
            f"parallelize: the strategy runs ZeRO stage 2 on layers {names[2]} and stage 3 on "
            f"layers {names[3]}; one model runs one of the two: give those layers one stage "
            f"(LayerStrategy.zero, sbpflow.auto.space.zero_twin)")
    for stage in (1, 2, 3):
        if ids[stage]:
            _zero_shard(model, stage, only=ids[stage])


# -- pipeline stages -------------------------------------------------------------------------------
def _stage_groups(graph, strategy, placement) -> list:
    """``[(stage placement, [layer indices])]``: ``placement`` and every layer without
    stages; else stage k on ``placement``'s ranks ``k * devices ..`` (row-major, 1-D) with its
    layers, which must be contiguous and in order."""
    pp = getattr(strategy, "pipeline", None)
    if pp is None:
        return [(placement, list(range(len(graph.layers))))]
    ranks, d = placement.flat_ranks, pp.devices
    stage = [getattr(s, "stage", 0) for s in strategy.layers]
    if stage != sorted(stage) or sorted(set(stage)) != list(range(pp.stages)):
        raise ParallelizeError(f"parallelize: layer stages {stage} are not 0 .. "
                               f"{pp.stages - 1} in layer order, each stage with a layer")
    return [(Placement(placement.device_type, list(ranks[k * d:(k + 1) * d])),
             [i for i, st in enumerate(stage) if st == k]) for k in range(pp.stages)]


def _prefixes(name: str) -> list:
    """``"a.b.c"`` -> ``["a", "a.b", "a.b.c"]``: the module and its ancestors, outermost first."""
    parts = name.split(".")
    return [".".join(parts[:j]) for j in range(1, len(parts) + 1)]


def _under(names: list, module: str) -> list:
    """Indices of the layers (by name) inside ``module``."""
    return [i for i, n in enumerate(names) if n == module or n.startswith(module + ".")]


def _clean(model, name: str) -> bool:
    """Whether a stage may start at module ``name``: it is called (not a ModuleList or
    ModuleDict) and its parent is the model, a ModuleList or a Sequential, whose forwards
    pass the activation on (a block's own forward may add to it a residual from before the
    cut, which would sit on the previous stage)."""
    if isinstance(model.get_submodule(name), (ModuleList, ModuleDict)):
        return False
    parent = name.rpartition(".")[0]
    return parent == "" or isinstance(model.get_submodule(parent), (ModuleList, Sequential))


def _clean_starts(model, names: list) -> set:
    """Layer indices a stage may start at: the first layer of a clean module."""
    return {i for i, n in enumerate(names) if i > 0 and
            any(_clean(model, p) and _under(names, p)[0] == i for p in _prefixes(n))}


def _snap_cuts(model, graph, strategy, notes: list):
    """``strategy`` with each stage starting at the nearest clean layer (`_clean_starts`;
    the earlier of two as near; the stages keep their order and a layer each), noted; a
    strategy without stages, or already clean, as it is."""
    pp = getattr(strategy, "pipeline", None)
    if pp is None:
        return strategy
    names = [l.name for l in graph.layers]
    stage = [getattr(s, "stage", 0) for s in strategy.layers]
    starts = [stage.index(k) if k in stage else None for k in range(pp.stages)]
    if None in starts or starts != sorted(starts):
        return strategy            # refused with its reason by `_stage_groups`
    clean, moved = _clean_starts(model, names), []
    for k in range(1, len(starts)):
        lo, hi = starts[k - 1] + 1, (starts[k + 1] if k + 1 < len(starts) else len(names)) - 1
        if starts[k] in clean:
            continue
        near = sorted((abs(i - starts[k]), i) for i in clean if lo <= i <= hi)
        if near:
            moved.append(f"stage {k} from {names[starts[k]]} to {names[near[0][1]]}")
            starts[k] = near[0][1]
    if not moved:
        return strategy
    bounds = starts + [len(names)]
    layers = [dataclasses.replace(s, stage=k) for k in range(len(starts))
              for s in strategy.layers[bounds[k]:bounds[k + 1]]]
    notes.append(f"stage cuts moved to module boundaries the activation alone crosses: "
                 f"{'; '.join(moved)}")
    return _restrategy(graph, layers, strategy)


def _split_points(model, graph, strategy, groups) -> list:
    """The module where each stage after the first starts: the outermost clean module
    (`_clean`; else any module) containing the stage's first layer whose traced layers are
    all in that stage (a GPT's block)."""
    names = [l.name for l in graph.layers]
    stage = [s.stage for s in strategy.layers]
    out = []
    for k, (_, idx) in enumerate(groups[1:], start=1):
        fits = [p for p in _prefixes(names[idx[0]])
                if all(stage[i] == k for i in _under(names, p))]
        out.append(next((p for p in fits if _clean(model, p)), fits[0]))
    return out


def _cut(model, graph, strategy, groups, stage_pls: list, skip: set):
    """`sf.parallel.pipeline` at the stages' split points (the parameters not in ``skip``
    replicated on their stage's stream, buffers moved, boundary hooks), checked against the
    strategy's stages. The parameters in ``skip`` (the traced layers', laid out next on their
    layer placements) are hidden from it: moved once, a meta one materialised as a shard."""
    split = _split_points(model, graph, strategy, groups)
    hidden = [(m, key, t) for m in model.modules() for key, t in m._parameters.items()
              if t is not None and id(t) in skip]
    for m, key, _ in hidden:
        m._parameters[key] = None
    try:
        _pipeline(model, stage_pls, split)
    finally:
        for m, key, t in hidden:
            m._parameters[key] = t
    from ..parallel.pipeline import pipeline_of
    pipe = pipeline_of(model)
    wrong = [f"{l.name} (stage {s.stage}, module stage {pipe.stage_of(l.name)})"
             for l, s in zip(graph.layers, strategy.layers) if pipe.stage_of(l.name) != s.stage]
    if wrong:
        pipe.remove()
        raise ParallelizeError(f"parallelize: cutting the model's modules at {split} puts "
                               f"layers {wrong} in other stages than the strategy's; cut the "
                               f"strategy where the model's module order allows")
    return pipe


# -- the strategy ----------------------------------------------------------------------------------
def _search(graph, cluster, algorithm: str, seed: int, memory_limit, one_mesh: bool, stages,
            notes: list, recompute: bool = False, zero=False):
    """``(strategy, breakdown)`` of the search (restricted to one mesh with ``one_mesh``;
    with pipeline stages unless ``stages`` is 1; recomputing twins in the space with
    ``recompute``, ZeRO twins with ``zero``)."""
    from .strategy_search import one_stage_search
    if one_mesh:
        if stages != 1:
            raise ParallelizeError("parallelize: one_mesh=True searches one stage; give "
                                   f"stages=1, not {stages!r}")
        strategy, bd, _ = single_mesh_search(graph, cluster, algorithm, seed, memory_limit,
                                             recompute=recompute, zero=zero)
        return strategy, bd
    if stages != 1:
        from .pipeline_search import find  # `search` without its warning: `_note_memory` says it
        res = find(graph, cluster, algorithm, seed, memory_limit=memory_limit, stages=stages,
                   recompute=recompute, zero=zero)
        return _cap_micro_batches(graph, res.strategy, cluster, notes, res.breakdown)
    res = one_stage_search(graph, cluster, algorithm, seed, memory_limit=memory_limit,
                           recompute=recompute, zero=zero)
    return res.strategy, res.breakdown


def _cap_micro_batches(graph, strategy, cluster, notes: list, bd):
    """``(strategy, breakdown)`` with at most ``graph.batch`` micro-batches (graph mode cuts
    the batch into balanced micro-batches, one sample at least), noted and priced again."""
    pp = getattr(strategy, "pipeline", None)
    if pp is None or not graph.batch or pp.micro_batches <= graph.batch:
        return strategy, bd
    m = graph.batch
    notes.append(f"the search chose {pp.micro_batches} micro-batches for a batch of "
                 f"{graph.batch} samples; running {m}")
    strategy = Strategy(graph, list(strategy.layers), pp._replace(micro_batches=m))
    return strategy, _breakdown(graph, strategy, cluster)


def _checked_arguments(model, placement, cluster):
    """`ParallelizeError` for a model, placement or cluster of the wrong kind; returns the
    cluster (default: one ``dgx-a100`` node of the placement's device count)."""
    from ..cost import Cluster

    if not isinstance(model, Module) and not is_torch_module(model):
        raise ParallelizeError(f"parallelize: model must be an sf.nn.Module or a torch.nn.Module, "
                               f"got {type(model).__name__}")
    if not isinstance(placement, Placement):
        raise ParallelizeError(f"parallelize: placement must be an sf.placement (e.g. "
                               f"sf.placement('cpu', ranks)), got {placement!r}")
    p = placement.size
    if cluster is None:
        return Cluster.preset("dgx-a100", nodes=1, devices_per_node=p)
    if not isinstance(cluster, Cluster):
        raise ParallelizeError(f"parallelize: cluster must be an sf.cost.Cluster (e.g. "
                               f"sf.cost.Cluster.preset({cluster!r}, nodes=1, "
                               f"devices_per_node={p}) for a preset's name), got {cluster!r}")
    if cluster.world_size != p:
        raise ParallelizeError(f"parallelize: cluster has {cluster.world_size} devices, "
                               f"placement {placement} has {p}")
    return cluster


def _given(graph, strategy, placement) -> Strategy:
    """A given strategy (a `Strategy`, a ``{layer name: LayerStrategy}`` dict or a sequence)
    as a `Strategy` of the traced ``graph``, checked against it and ``placement`` (each
    layer's mesh covers the devices of its stage)."""
    p = placement.size
    pp = getattr(strategy, "pipeline", None)
    if isinstance(strategy, dict):
        names = [l.name for l in graph.layers]
        missing, unknown = [n for n in names if n not in strategy], \
            sorted(set(strategy) - set(names))
        if missing or unknown:
            raise ParallelizeError(f"parallelize: the strategy dict misses layers {missing} and "
                                   f"names unknown ones {unknown}; the traced layers: {names}")
        strategy = Strategy(graph, strategy)
    elif not isinstance(strategy, Strategy):
        layers = _as_list(strategy)  # once: a generator is read once (a string: its letters)
        if not all(isinstance(s, LayerStrategy) for s in layers):
            raise ParallelizeError(f"parallelize: strategy must be a Strategy, a {{layer name: "
                                   f"LayerStrategy}} dict or a sequence of LayerStrategy (a "
                                   f"baseline: sf.auto.baselines), got {strategy!r}")
        strategy = Strategy(graph, layers)
    elif strategy.graph is not graph:
        strategy = _restrategy(graph, list(strategy.layers), strategy)
    if len(strategy.layers) != len(graph.layers):
        raise ParallelizeError(f"parallelize: strategy has {len(strategy.layers)} layers, "
                               f"the traced graph {len(graph.layers)}")
    d = p
    if pp is not None:
        if pp.stages * pp.devices != p:
            raise ParallelizeError(f"parallelize: {pp.stages} stages x {pp.devices} devices "
                                   f"!= the {p} devices of placement {placement}")
        d = pp.devices
    bad = [l.name for l, s in zip(graph.layers, strategy.layers) if s.devices != d]
    if bad:
        raise ParallelizeError(f"parallelize: layers {bad} have meshes that are not "
                               f"{d} devices (placement {placement})")
    return strategy


def _as_list(value) -> list:
    try:
        return list(value)
    except TypeError:
        return [value]


def _placements_by_mesh(placement):
    """A function mesh -> placement: ``placement``'s ranks in row-major order reshaped to the
    mesh, one placement object per distinct mesh."""
    by_mesh: dict = {}

    def on(mesh):
        mesh = tuple(mesh)
        if mesh not in by_mesh:
            by_mesh[mesh] = placement if tuple(placement.shape) == mesh \
                else placement.reshape(*mesh)
        return by_mesh[mesh]
    return on


def _stream(layers: list, on, notes: list) -> _ActivationPlacement:
    """The stream the activations of ``layers`` (their strategies) live on: the common
    refinement of their meshes or, if there is none, the layer mesh that refines the meshes
    of the most layers (noted)."""
    mesh_counts = Counter(s.mesh for s in layers)
    fine = common_refinement(list(mesh_counts))
    if fine is None:
        fine = max(mesh_counts, key=lambda f: (
            sum(c for m, c in mesh_counts.items() if _owner(m, f) is not None), mesh_counts[f]))
        others = sorted(m for m in mesh_counts if _owner(m, fine) is None)
        notes.append(f"meshes {sorted(mesh_counts)} have no common refinement: activations "
                     f"live on {fine}; layers on {others} take their input by a "
                     f"cross-placement boxing and return their output replicated")
    return _ActivationPlacement(on(fine), {m: _owner(m, fine) for m in mesh_counts})
