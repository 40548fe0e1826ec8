"""``split=``: cut an ``sf.nn.Sequential`` into N contiguous stages of balanced weight.

The Sequential's modules are grouped into units, each a module with parameters followed by
the parameter-free modules after it (activations stay with their layer); units are then cut
into N contiguous stages minimising the heaviest stage, ties broken by the most even weights.
Weight is the parameter count (``split=N`` or ``(N, "params")``) or a FLOP estimate per sample
(``(N, "flops")``: 2 multiply-adds a weight of a Linear or a Conv2d (per output position),
a FLOP a parameter elsewhere). See docs/cdp.md, 'Stages'.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from ...errors import PlanError
from ...nn.modules import Conv2d, Linear, Module, Sequential

__all__ = ["split_sequential", "stage_list", "module_weight"]

BY = ("params", "flops")


def module_weight(m: Module, by: str) -> int:
    """``m``'s parameter count, or its FLOP estimate per sample (see the module docstring)."""
    if by not in BY:
        raise PlanError(f"split by {by!r}: one of {BY}")
    total = 0
    for sub in m.modules() if hasattr(m, "modules") else [m]:
        own = [p for p in sub._parameters.values() if p is not None]
        if by == "flops" and isinstance(sub, (Linear, Conv2d)):
            total += 2 * sub.weight.numel() + (sub.bias.numel() if sub.bias is not None else 0)
        else:
            total += sum(p.numel() for p in own)
    return total


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


def split_sequential(seq: Sequential, n: int, by: str = "params") -> list[Sequential]:
    """``seq`` cut into ``n`` stages (each an ``sf.nn.Sequential`` sharing the modules and
    keeping their names)."""
    units = _units(seq)
    if len(units) < n:
        raise PlanError(f"split=: cannot cut a Sequential of {len(units)} layers with "
                        f"parameters ({list(seq._modules)}) into {n} stages; pass fewer "
                        f"stages or a list of {n} stage modules")
    weights = [sum(module_weight(m, by) for _, m in unit) for unit in units]
    cuts = _balanced_cuts(weights, n) + [len(units)]
    return [Sequential(OrderedDict(item for unit in units[cuts[k]:cuts[k + 1]]
                                   for item in unit)) for k in range(n)]


def stage_list(stages, split) -> list[Module]:
    """The stages of `CyclicDataParallel`: a list of modules as given, or a Sequential cut by
    ``split`` (an int N, or ``(N, "params" | "flops")``)."""
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
    n, by = (split, "params") if isinstance(split, int) else tuple(split)
    if not isinstance(n, int) or n < 2:
        raise PlanError(f"split= needs N >= 2 stages, got {split!r}")
    return split_sequential(stages, n, by)
