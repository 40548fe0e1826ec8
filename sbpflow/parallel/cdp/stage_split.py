"""``split=``: cut an ``sf.nn.Sequential`` into N contiguous stages of balanced weight.

The Sequential's modules are grouped into units, each a module with parameters followed by
the parameter-free modules after it (activations stay with their layer); units are then cut
into N contiguous stages minimising the heaviest stage, ties broken by the most even weights.
Weight is the parameter count (``split=N`` or ``(N, "params")``) or a FLOP estimate per sample
(``(N, "flops")``, which needs an example input: each sub-module's output shape is read on
meta tensors; `call_flops` gives the count of one call). See docs/cdp.md, 'Stages'.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Sequence

import torch

from ...comm import current
from ...errors import PlanError
from ...nn.layers import Conv2d, Embedding, Linear, Sequential
from ...nn.modules import Module
from ...placement import placement
from ...tensor import GlobalTensor
from .stage_runner import StageRunner

__all__ = ["split_sequential", "stage_list", "check_untied", "call_flops", "flop_weights"]

BY = ("params", "flops")


def call_flops(m: Module, out_shape: Sequence[int]) -> int:
    """FLOPs of one call of ``m`` that returned ``out_shape``: 2 x output elements x fan-in
    for a Linear (in_features) or a Conv2d (in_channels / groups x kernel area; bias adds
    not counted), 0 for an Embedding (a lookup), the output's element count for any other
    module without sub-modules (elementwise, norm, pooling), 0 for a container (its
    sub-modules' calls count)."""
    out = math.prod(out_shape)
    if isinstance(m, Linear):
        return 2 * out * m.weight.shape[-1]
    if isinstance(m, Conv2d):
        return 2 * out * math.prod(m.weight.shape[1:])
    if isinstance(m, Embedding) or m._modules:
        return 0
    return out


def flop_weights(seq: Sequential, example_input) -> list[int]:
    """Per sample (``example_input``'s axis 0), the FLOPs of each module of ``seq``: its
    sub-modules' calls (`call_flops`) on meta tensors of the example's shape and dtype."""
    shape = tuple(getattr(example_input, "shape", ()))
    if not isinstance(example_input, (torch.Tensor, GlobalTensor)) or not shape or not shape[0]:
        raise PlanError(f"split=(N, 'flops'): example_input= must be a tensor with a batch "
                        f"axis 0 (such as the x given to step), got "
                        f"{shape or type(example_input).__name__}")
    pl = placement("cpu", [current().rank])
    calls = StageRunner(seq, 0).trace(shape, example_input.dtype, pl)
    weights = []
    for m in seq._modules.values():
        inside = {id(sub) for _, sub in m.named_modules()}
        total = sum(call_flops(sub, out) for sub, out in calls if id(sub) in inside)
        weights.append(total // shape[0])
    return weights


def _units(seq: Sequential) -> list[list[tuple[str, Module]]]:
    """Each module with parameters starts a unit; parameter-free modules join the current one
    (leading ones the first)."""
    units: list[list] = []
    started = False  # the last unit has a module with parameters
    for name, m in seq._modules.items():
        has_params = next(iter(m.parameters()), None) is not None
        if not units or (has_params and started):
            units.append([(name, m)])
            started = has_params
        else:
            units[-1].append((name, m))
            started = started or has_params
    return units


def _balanced_cuts(weights: Sequence[int], n: int) -> list[int]:
    """Start indices of ``n`` contiguous non-empty groups minimising (max, sum of squares)."""
    u = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = (float("inf"), float("inf"))
    # best[k][e]: the best cost of cutting units [0, e) into k groups, and the last start
    best = [[(inf, -1)] * (u + 1) for _ in range(n + 1)]
    best[0][0] = ((0, 0), -1)
    for k in range(1, n + 1):
        for e in range(k, u + 1):
            for s in range(k - 1, e):
                (mx, sq), _ = best[k - 1][s]
                if mx == float("inf"):
                    continue
                w = prefix[e] - prefix[s]
                cost = (max(mx, w), sq + w * w)
                if cost < best[k][e][0]:
                    best[k][e] = (cost, s)
    cuts, e = [], u
    for k in range(n, 0, -1):
        s = best[k][e][1]
        cuts.append(s)
        e = s
    return cuts[::-1]


def split_sequential(seq: Sequential, n: int, by: str = "params", example_input=None
                     ) -> list[Sequential]:
    """``seq`` cut into ``n`` stages (each an ``sf.nn.Sequential`` sharing the modules and
    keeping their names), balanced by parameter count or, with ``by="flops"``, by FLOPs per
    sample on ``example_input`` (a batch; only its shape and dtype are read)."""
    if by not in BY:
        raise PlanError(f"split by {by!r}: one of {BY}")
    if by == "flops" and example_input is None:
        raise PlanError("split=(N, 'flops') needs example_input= (a batch such as the x "
                        "given to step; only its shape and dtype are read): the FLOPs of "
                        "a layer depend on its output size")
    units = _units(seq)
    if len(units) < n:
        raise PlanError(f"split=: cannot cut a Sequential of {len(units)} layers with "
                        f"parameters ({list(seq._modules)}) into {n} stages; pass fewer "
                        f"stages or a list of {n} stage modules")
    if by == "flops":
        of = dict(zip(seq._modules, flop_weights(seq, example_input)))
    else:
        of = {name: sum(p.numel() for p in m.parameters()) for name, m in seq._modules.items()}
    weights = [sum(of[name] for name, _ in unit) for unit in units]
    cuts = _balanced_cuts(weights, n) + [len(units)]
    return [Sequential(OrderedDict(item for unit in units[cuts[k]:cuts[k + 1]]
                                   for item in unit)) for k in range(n)]


def check_untied(stages: Sequence[Module]) -> None:
    """Refuse a parameter or buffer (the same tensor object) in two stages: each stage has
    versions and an optimizer of its own, so tied weights would silently become two."""
    seen: dict[int, tuple[int, str]] = {}
    for j, stage in enumerate(stages):
        named = list(stage.named_parameters()) + list(stage.named_buffers())
        for name, t in named:
            k, first = seen.setdefault(id(t), (j, name))
            if k != j:
                raise PlanError(f"CDP stages {k} and {j} share a tensor (stage {k}'s {first!r}"
                                f" is stage {j}'s {name!r}, shape {tuple(t.shape)}): tied "
                                f"weights across CDP stages are not supported (each stage "
                                f"has its own versions and optimizer); keep the tied layers "
                                f"in one stage, or give each stage its own copy")


def stage_list(stages, split, example_input=None) -> list[Module]:
    """The stages of `CyclicDataParallel`: a list of modules as given, or a Sequential cut by
    ``split`` (an int N, or ``(N, "params" | "flops")``; "flops" reads ``example_input``).
    No tensor may sit in two stages (`check_untied`); every stage has parameters (each has
    an optimizer and versions)."""
    out = _stage_modules(stages, split, example_input)
    check_untied(out)
    empty = [j for j, m in enumerate(out) if not list(m.parameters())]
    if empty:
        raise PlanError(f"CyclicDataParallel: stages {empty} have no parameters (each stage "
                        f"keeps versions and an optimizer); put their modules into a "
                        f"neighbouring stage (sf.nn.Sequential)")
    return out


def _stage_modules(stages, split, example_input) -> list[Module]:
    if split is None:
        if isinstance(stages, Module):
            raise PlanError("CyclicDataParallel got one module: pass a list of stage modules, "
                            "or a Sequential with split=N (or (N, 'flops'))")
        out = list(stages)
        bad = [type(s).__name__ for s in out if not isinstance(s, Module)]
        if bad:
            raise PlanError(f"CyclicDataParallel stages must be sf.nn modules, got {bad}")
        return out
    if not isinstance(stages, Sequential):
        raise PlanError(f"split= cuts an sf.nn.Sequential, got {type(stages).__name__}")
    if not isinstance(split, int) and not (isinstance(split, (tuple, list)) and len(split) == 2):
        raise PlanError(f"split= is an int N or (N, 'params' | 'flops'), got {split!r}")
    n, by = (split, "params") if isinstance(split, int) else tuple(split)
    if not isinstance(n, int) or n < 2:
        raise PlanError(f"split= needs N >= 2 stages, got {split!r}")
    return split_sequential(stages, n, by, example_input)
