"""Pipeline stages of a strategy on the model's modules (`sf.auto.parallelize`'s stage cuts).

`snap_cuts` moves each stage's first layer to the nearest module boundary that the activation
alone crosses; `stage_groups` gives each stage its placement (``placement``'s ranks in row-major
order, a stage's devices each) and layers; `cut_stages` cuts the model there with
`sf.parallel.pipeline` and checks that every traced layer lands in its strategy's stage.
See docs/auto.md, 'Tied weights and pipelined strategies'.
"""

from __future__ import annotations

import dataclasses

from ..errors import ParallelizeError
from ..nn.layers import ModuleDict, ModuleList, Sequential
from ..parallel.pipeline import pipeline as _pipeline
from ..placement import Placement
from .space import Strategy

__all__ = ["cut_stages", "layers_under", "module_prefixes", "restrategy", "snap_cuts",
           "stage_groups"]


def restrategy(graph, layers: list, like) -> Strategy:
    """A `Strategy` of ``graph`` with ``layers`` and the pipeline of strategy ``like``."""
    pp = getattr(like, "pipeline", None)
    return Strategy(graph, layers, *([pp] if pp is not None else []))


def stage_groups(graph, strategy, placement) -> list:
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


def module_prefixes(name: str) -> list:
    """``"a.b.c"`` -> ``["a", "a.b", "a.b.c"]``: the module and its ancestors, outermost first."""
    parts = name.split(".")
    return [".".join(parts[:j]) for j in range(1, len(parts) + 1)]


def layers_under(names: list, module: str) -> list:
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
            any(_clean(model, p) and layers_under(names, p)[0] == i for p in module_prefixes(n))}


def snap_cuts(model, graph, strategy, notes: list):
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
        return strategy            # refused with its reason by `stage_groups`
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
    return restrategy(graph, layers, strategy)


def _split_points(model, graph, strategy, *, groups: list) -> list:
    """The module where each stage after the first starts: the outermost clean module
    (`_clean`; else any module) containing the stage's first layer whose traced layers are
    all in that stage (a GPT's block)."""
    names = [l.name for l in graph.layers]
    stage = [s.stage for s in strategy.layers]
    out = []
    for k, (_, idx) in enumerate(groups[1:], start=1):
        fits = [p for p in module_prefixes(names[idx[0]])
                if all(stage[i] == k for i in layers_under(names, p))]
        out.append(next((p for p in fits if _clean(model, p)), fits[0]))
    return out


def cut_stages(model, graph, strategy, *, groups: list, stage_pls: list, skip: set):
    """`sf.parallel.pipeline` at the stages' split points (the parameters not in ``skip``
    replicated on their stage's stream, buffers moved, boundary hooks), checked against the
    strategy's stages. The parameters in ``skip`` (the traced layers', laid out next on their
    layer placements) are hidden from it: moved once, a meta one materialised as a shard."""
    split = _split_points(model, graph, strategy, groups=groups)
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
