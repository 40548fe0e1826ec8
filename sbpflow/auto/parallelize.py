"""``sf.auto.parallelize``: search (or take) a strategy for an ``sf.nn`` model and make the model
run with it, each layer on its own mesh.

    plan = sf.auto.parallelize(model, (tokens, positions, targets), placement, cluster)
    x = plan.input(torch_batch)          # replicated onto plan.placement (any layout works)
    loss = model(x, ...); loss.backward(); opt.step()   # build the optimizer after parallelize

A recipe: it traces the model (`trace`), searches or takes a strategy, snaps pipeline stage
cuts to module boundaries (`stage_cuts`), puts a tied weight's users on one layout
(`tied_weights`), and lays the model out (`model_layout`: each layer's parameters on its mesh's
placement, activations between layers on one *stream placement* a stage). See docs/auto.md,
'Laying out a model' and 'Tied weights and pipelined strategies'.
"""

from __future__ import annotations

import math
import random
import sys
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field

from ..errors import GraphError, ParallelizeError, TraceError
from ..nn.modules import Module
from ..nn.torch_modules import from_torch, is_torch_module
from ..placement import Placement
from ..sbp import B, Broadcast
from .checks import MemoryLimitWarning
from .evaluate import Breakdown, Evaluator
from .model_layout import LaidOut, common_refinement, graph_refusal, lay_out
from .space import LayerStrategy, Strategy, layer_space, meshes, zero_twin
from .stage_cuts import restrategy, snap_cuts
from .tied_weights import near_cost, tie_weights
from .trace import trace

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
            raise GraphError(graph_refusal(rc))
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
    notes: list[str] = []
    graph, modules = _traced(model, example_inputs, meta=meta, notes=notes)
    t0 = time.perf_counter()
    if strategy is None:
        chosen, bd = _search(graph, cluster, algorithm=algorithm, seed=seed,
                             memory_limit=memory_limit, one_mesh=one_mesh, stages=stages,
                             recompute=recompute, zero=zero, notes=notes)
    else:
        chosen, bd = _taken(graph, strategy, placement=placement, cluster=cluster,
                            one_mesh=one_mesh, notes=notes), None
    snapped = snap_cuts(model, graph, chosen, notes=notes)
    strategy = tie_weights(graph, snapped, modules=modules,
                           ev=_evaluator(graph, snapped, cluster), notes=notes)
    if bd is None or strategy is not chosen:
        bd = _breakdown(graph, strategy, cluster)
    _note_memory(bd, limit=memory_limit, cluster=cluster, notes=notes,
                 options={"zero=True": zero, "recompute=True": recompute,
                          "stages='search'": stages == "search"})
    seconds = time.perf_counter() - t0
    laid = lay_out(model, graph, strategy, modules=modules, placement=placement, notes=notes)
    plan = _plan(graph, strategy, laid, breakdown=bd, modules=modules, model=model,
                 notes=notes, seconds=seconds)
    object.__setattr__(model, "auto_plan", plan)
    return plan


def _plan(graph, strategy, laid: LaidOut, *, breakdown, modules: dict, model, notes: list,
          seconds: float) -> ParallelPlan:
    """The `ParallelPlan` of ``strategy`` laid out (``laid``), with how to run its step: a
    pipeline's micro-batches and schedule, else the breakdown's micro-batches, 1F1B."""
    pp = getattr(strategy, "pipeline", None)
    micro_batches = pp.micro_batches if pp is not None else \
        (breakdown.micro_batches if breakdown is not None else 1)
    return ParallelPlan(graph=graph, strategy=strategy, placement=laid.placement,
                        breakdown=breakdown, modules=modules, notes=notes, search_seconds=seconds, placements=laid.placements, model=model,
                        stages=laid.stages, pipeline=laid.pipeline, micro_batches=micro_batches,
                        schedule=pp.schedule if pp is not None else "1f1b")


def _taken(graph, strategy, *, placement, cluster, one_mesh: bool, notes: list) -> Strategy:
    """A given strategy as a `Strategy` of ``graph`` (`_given`), moved onto one mesh with
    ``one_mesh`` (`_to_one_mesh`; a pipelined one refused)."""
    strategy = _given(graph, strategy, placement)
    if one_mesh:
        if getattr(strategy, "pipeline", None) is not None:
            raise ParallelizeError("parallelize: one_mesh=True with a pipelined strategy; "
                                   "give one or the other")
        strategy = _to_one_mesh(graph, strategy, cluster, notes=notes)
    return strategy


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


def _traced(model, example_inputs, *, meta, notes: list) -> tuple:
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


def _search(graph, cluster, *, algorithm: str, seed: int, memory_limit, one_mesh: bool, stages,
            recompute: bool = False, zero=False, notes: list):
    """``(strategy, breakdown)`` of the search (restricted to one mesh with ``one_mesh``;
    with pipeline stages unless ``stages`` is 1; recomputing twins in the space with
    ``recompute``, ZeRO twins with ``zero``)."""
    from .strategy_search import one_stage_search
    if one_mesh:
        if stages != 1:
            raise ParallelizeError("parallelize: one_mesh=True searches one stage; give "
                                   f"stages=1, not {stages!r}")
        strategy, bd, _ = single_mesh_search(graph, cluster, algorithm, seed=seed,
                                             memory_limit=memory_limit, recompute=recompute,
                                             zero=zero)
        return strategy, bd
    if stages != 1:
        from .pipeline_search import find  # `search` without its warning: `_note_memory` says it
        res = find(graph, cluster, algorithm, seed=seed, memory_limit=memory_limit,
                   stages=stages, recompute=recompute, zero=zero)
        return _cap_micro_batches(graph, res.strategy, cluster, breakdown=res.breakdown,
                                  notes=notes)
    res = one_stage_search(graph, cluster, algorithm, seed=seed, memory_limit=memory_limit,
                           recompute=recompute, zero=zero)
    return res.strategy, res.breakdown


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
            pb = Problem(graph, cluster, memory_limit=memory_limit, micro_batches=1,
                         max_dims=max_dims, zero=False, spaces=spaces)
            state, cost = ALGORITHMS[algorithm](pb, random.Random(seed), None,
                                                time.perf_counter(), [], **options)
            if best is None or cost < best[2]:
                best = (pb.strategy(state), pb, cost)
    if best is None:
        raise ValueError(f"no mesh of {p} devices fits every layer of {graph.name}")
    strategy, pb, cost = best
    return strategy, pb.ev.breakdown(strategy), cost


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
        strategy = restrategy(graph, list(strategy.layers), strategy)
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
            return 0.0 if ev is None else near_cost(ev, graph, layers, j=i, c=c)
        layers[i] = zero_twin(l, min(cands, key=cost), s.zero)   # keeps the layer's stage
        moved.append(f"{l.name} {s.mesh}->{layers[i].label or layers[i]}")
    notes.append(f"layers use meshes {dict(counts)}; all moved to the majority mesh {mesh} "
                 f"({', '.join(moved)})")
    return Strategy(graph, layers)


def _cap_micro_batches(graph, strategy, cluster, *, breakdown, notes: list):
    """``(strategy, breakdown)`` with at most ``graph.batch`` micro-batches (graph mode cuts
    the batch into balanced micro-batches, one sample at least), noted and priced again."""
    pp = getattr(strategy, "pipeline", None)
    if pp is None or not graph.batch or pp.micro_batches <= graph.batch:
        return strategy, breakdown
    m = graph.batch
    notes.append(f"the search chose {pp.micro_batches} micro-batches for a batch of "
                 f"{graph.batch} samples; running {m}")
    strategy = Strategy(graph, list(strategy.layers), pp._replace(micro_batches=m))
    return strategy, _breakdown(graph, strategy, cluster)


def _note_memory(bd: Breakdown, *, limit, cluster, notes: list, options: dict) -> None:
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
