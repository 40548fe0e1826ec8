"""A warning for costly parameter rules: a split fused projection whose output the model cuts.

A rule that splits a `Linear`'s output features (weight ``S(0)`` on a mesh dim of several ranks)
is Megatron's column parallelism, which is free while the output stays split. A fused projection
such as attention's ``c_attn`` (rows ``[q | k | v]``) is then cut by the model into pieces along
that same axis (``split`` / ``chunk``): each piece straddles ranks, so every step gathers the
output whole first (all-gather forward, its dual backward) and what follows runs replicated.
`watch_fused_splits` (called by ``sf.parallel.apply``) watches the first forward of each such
layer and warns, naming the rule and the fix. See docs/torch_models.md, 'Costly layouts'.
"""

from __future__ import annotations

import warnings
from typing import Mapping

from .. import comm as _comm
from ..placement import Placement
from ..sbp import B, Split, format_nd_sbp
from ..tensor import GlobalTensor, watch_resplit
from .modules import Linear, Module

__all__ = ["watch_fused_splits", "CostlyLayoutWarning"]


class CostlyLayoutWarning(UserWarning):
    """A layout that is valid but moves much more data than another would."""


def _column_split_dims(nd: tuple, placement: Placement) -> list[int]:
    return [d for d, s in enumerate(nd)
            if isinstance(s, Split) and s.axis == 0 and placement.shape[d] > 1]


def watch_fused_splits(model: Module, placement: Placement,
                       layouts: Mapping[str, tuple]) -> int:
    """Watch the first forward of every `Linear` whose weight ``layouts`` (parameter name ->
    nd-sbp on ``placement``) splits by output features: if the model cuts that output with
    ``split`` / ``chunk`` along its last axis, warn (`CostlyLayoutWarning`, on the placement's
    first rank) with the fix. Returns the number of layers watched."""
    watched = 0
    for mod_name, m in model.named_modules():
        if not isinstance(m, Linear) or m._parameters.get("weight") is None:
            continue
        name = f"{mod_name}.weight" if mod_name else "weight"
        nd = layouts.get(name)
        if nd is None or not _column_split_dims(tuple(nd), placement):
            continue
        _watch(m, mod_name or type(m).__name__, tuple(nd), placement)
        watched += 1
    return watched


def _watch(m: Module, name: str, nd: tuple, placement: Placement) -> None:
    def hook(module, args, out):
        handle.remove()
        if isinstance(out, GlobalTensor):
            watch_resplit(out, lambda t, dim: _check(t, dim, name, nd, placement))
    handle = m.register_forward_hook(hook)


def _check(t: GlobalTensor, dim: int, name: str, nd: tuple, placement: Placement) -> None:
    last = t.ndim - 1
    if dim % max(t.ndim, 1) != last or _comm.rank() != placement.flat_ranks[0]:
        return
    if not any(isinstance(s, Split) and s.axis == last for s in t.sbp):
        return
    kept = tuple(B if d in _column_split_dims(nd, placement) else s for d, s in enumerate(nd))
    warnings.warn(
        f"sf.parallel.apply: {name}.weight is laid out {format_nd_sbp(nd)} on {placement}, "
        f"which splits its output features across ranks, and the model cuts its output into "
        f"pieces along that axis (split / chunk: a fused projection such as attention's "
        f"[q | k | v]). Each piece straddles ranks, so every step gathers the whole output "
        f"first (all-gather forward, reduce-scatter backward) and the layers after it run "
        f"replicated. Fix: keep it unsplit there (a rule '{name}.*': {format_nd_sbp(kept)}), "
        f"or order its rows so that each rank's block holds whole pieces (for attention, per "
        f"head [q_h | k_h | v_h]) and cut it per head with a reshape to (..., heads, 3, "
        f"head_dim); see docs/torch_models.md, 'Costly layouts'",
        CostlyLayoutWarning, stacklevel=2)
