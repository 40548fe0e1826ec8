"""Laying a model out for a strategy (`sf.auto.parallelize`): `lay_out`.

Each traced layer's parameters go on its mesh's placement with its strategy's layouts (graph
axes turned into module axes: `module_nd`; a bias follows its weight) by `sf.parallel.relayout`,
a pipeline is cut into stages (`stage_cuts`), each layer runs its ZeRO stage, and each traced
module's forward is wrapped so that activations live between layers on one *stream placement*
a stage, the common refinement of its layer meshes (`common_refinement`), entering a layer by a
boxing (a relabelling where the shards are the same) and leaving it back onto the stream; a
recomputing layer runs under `sf.nn.checkpoint`. See docs/auto.md, 'Laying out a model'.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import NamedTuple

from ..errors import GraphError, ParallelizeError
from ..layouts import Layout
from ..nn.layers import ModuleDict, ModuleList
from ..nn.recompute import checkpoint as _checkpoint
from ..parallel.relayout import relayout
from ..parallel.tie import install_views, tie_placement
from ..parallel.zero import shard as _zero_shard
from ..sbp import B, Broadcast, S, Split, format_nd_sbp, shard_box
from ..tensor import recording
from .space import LayerStrategy
from .stage_cuts import cut_stages, layers_under, module_prefixes, stage_groups

__all__ = ["LaidOut", "common_refinement", "graph_refusal", "lay_out", "module_nd"]


class LaidOut(NamedTuple):
    """What `lay_out` did: ``placement``, stage 0's stream placement (where the inputs go);
    ``placements``, each layer's placement by name; ``stages``, each stage's stream placement
    (empty without a pipeline); ``pipeline``, the `sf.parallel.pipeline` record or None."""

    placement: object
    placements: dict
    stages: list
    pipeline: object


def lay_out(model, graph, strategy, *, modules: dict, placement, notes: list) -> LaidOut:
    """Lay ``model`` out for ``strategy`` of its traced ``graph`` in place (``modules``: the
    traced layers' modules by name; ``placement``: every rank's): the stages cut, each
    layer's parameters on its placement, the buffers on the stream, the ZeRO stages run, the
    traced modules' forwards wrapped. Appends to ``notes`` what it had to change."""
    groups = stage_groups(graph, strategy, placement)
    placements, streams = {}, []
    for stage_pl, idx in groups:
        on = _placements_by_mesh(stage_pl)
        for i in idx:
            placements[graph.layers[i].name] = on(strategy.layers[i].mesh)
        streams.append(_stream([strategy.layers[i] for i in idx], on, notes))
    layouts = _layouts(graph, strategy, modules=modules, placements=placements)
    pipe = None
    if len(groups) > 1:   # stage placements for the untraced parameters, buffers, hooks
        pipe = cut_stages(model, graph, strategy, groups=groups,
                          stage_pls=[st.placement for st in streams], skip=set(layouts))
    replicated = Layout.parsed(streams[0].placement, (B,) * streams[0].placement.ndim)
    relayout(model, lambda _, p: layouts[id(p)].layout if id(p) in layouts else
             (p.global_layout if pipe is not None else replicated), "parallelize")
    if pipe is None:
        _move_buffers(model, streams[0].placement)
    _tie_views(graph, strategy, modules=modules, placements=placements)
    _zero_stages(model, graph, strategy, modules=modules)
    _wrap_forwards(model, graph, strategy, modules=modules, placements=placements,
                   streams=streams, groups=groups)
    stages = [st.placement for st in streams] if pipe is not None else []
    return LaidOut(placement=streams[0].placement, placements=placements, stages=stages,
                   pipeline=pipe)


def _wrap_forwards(model, graph, strategy, *, modules: dict, placements: dict, streams: list,
                   groups: list) -> None:
    """Each traced module's forward between its stage's stream and its layer's layouts
    (`_wrap`), the recomputation regions under `sf.nn.checkpoint` (those of an earlier
    `parallelize` undone first)."""
    for m in model.modules():   # recomputation regions of an earlier parallelize
        if getattr(m.__dict__.get("forward"), "sf_recompute", False):
            del m.__dict__["forward"]
    regions = _recompute_regions(model, graph, strategy)
    for k, (_, idx) in enumerate(groups):
        for i in idx:
            layer = graph.layers[i]
            _wrap(modules[layer.name], layer.kind, strategy.layers[i],
                  pl=placements[layer.name], stream=streams[k], name=layer.name,
                  alone=layer.name in regions)
    for name in regions:
        if name not in modules:
            _checkpoint_module(model.get_submodule(name), name)


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


class _ParamLayout(NamedTuple):
    """Where `lay_out` puts a traced layer's parameter, and the layer that says so."""

    layout: Layout
    layer: str


def _layouts(graph, strategy, *, modules: dict, placements: dict) -> dict:
    """id(parameter) -> its `_ParamLayout` for every traced layer's parameters (a tied
    layer's weight is its holder's; its bias follows that weight); a parameter shared by
    layers with different layouts raises."""
    out: dict = {}
    for layer, s in zip(graph.layers, strategy.layers):
        m = modules[layer.name]
        pl = placements[layer.name]
        if layer.tied is not None:
            hl = graph[layer.tied]
            w, out_axis = module_nd(hl, strategy[layer.tied].weight), _out_axis(hl)
            want = []
        else:
            w, out_axis = module_nd(layer, s.weight), _out_axis(layer)
            want = [(m.weight, w)]
        if getattr(m, "bias", None) is not None:
            want.append((m.bias, _bias_of(w, out_axis)))
        for p, nd in want:
            prev = out.get(id(p))
            if prev is not None and prev.layout != (pl, nd):
                ppl, pnd = prev.layout
                raise ParallelizeError(
                    f"parallelize: a parameter of shape {tuple(p.shape)} is shared by layers "
                    f"{prev.layer} (on {ppl} with sbp {format_nd_sbp(pnd)}) and "
                    f"{layer.name} (on {pl} with sbp {format_nd_sbp(nd)}); give a strategy in "
                    f"which they lay it out alike")
            out[id(p)] = _ParamLayout(Layout.parsed(pl, nd), layer.name)
    for user, holder in graph.ties.items():   # across stages: one copy a stage
        su, sh = strategy[user], strategy[holder]
        if getattr(su, "stage", 0) != getattr(sh, "stage", 0):
            w = modules[holder].weight
            tied = tie_placement(f"the weight of {holder} and {user}",
                                 [placements[holder], placements[user]],
                                 [out[id(w)].layout.sbp] * 2, "parallelize")
            out[id(w)] = _ParamLayout(tied, holder)
    return out


def _tie_views(graph, strategy, *, modules: dict, placements: dict) -> None:
    """The users of a weight tied across stages read it through their stage's view."""
    for user, holder in graph.ties.items():
        if getattr(strategy[user], "stage", 0) != getattr(strategy[holder], "stage", 0):
            install_views(modules[holder].weight,
                          [(modules[n], "weight", placements[n]) for n in (holder, user)])


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


def _zero_stages(model, graph, strategy, *, modules: dict) -> None:
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


def _wrap(module, kind, s: LayerStrategy, *, pl, stream: _ActivationPlacement, name: str,
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
            raise GraphError(graph_refusal([name]))
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
        for p in module_prefixes(n):
            under = layers_under(names, p)
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
            raise GraphError(graph_refusal([name]))
        return _checkpoint(orig, *args, **kw)
    forward.sf_recompute = True   # undone by the next `parallelize`
    object.__setattr__(module, "forward", forward)


def graph_refusal(names: list) -> str:
    """Why a recomputing plan does not run as an ``sf.nn.Graph``, and the fix."""
    return (f"parallelize: layers {names} recompute their forward in backward (strategy "
            f"'+rc', LayerStrategy.recompute=True), and a graph does not run activation "
            f"checkpointing yet (it would keep the activations). Run the step eagerly "
            f"(model(...); loss.backward(); opt.step()), or search without recomputation "
            f"(parallelize(..., recompute=False), the default) / give a strategy whose "
            f"layers have recompute=False")


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

    def _same_shards(self, shape, src: tuple, dst: tuple) -> bool:
        """Whether every rank holds the same region of a ``shape`` tensor under layouts
        ``src`` and ``dst`` (each ``(placement, nd-sbp)``), memoised."""
        key = (shape, src, dst)
        hit = self._same.get(key)
        if hit is None:
            if len(self._same) > 4096:
                self._same.clear()
            (src_pl, src_nd), (dst_pl, dst_nd) = src, dst
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
                self._same_shards(shape, (x.placement, tuple(x.sbp)), (pl, tuple(nd))):
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


def module_nd(layer, nd) -> tuple:
    """A layer's weight layout in its module's axes (a Linear's weight is ``(out, in)``, a
    `stores_in_out` module's ``(in, out)`` as the graph's)."""
    if layer.kind == "linear" and not layer.attrs.get("weight_in_out"):
        return _swap01(nd)
    return tuple(nd)
