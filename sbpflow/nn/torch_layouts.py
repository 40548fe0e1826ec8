"""Costly parameter rules: a split fused projection whose output the model cuts, and a
projection split on its narrow side.

A rule that splits a `Linear`'s output features (weight ``S(0)`` on a mesh dim of several ranks)
is Megatron's column parallelism, which is free while the output stays split. A fused projection
such as attention's ``c_attn`` (rows ``[q | k | v]``) is then cut by the model into pieces along
that same axis (``split`` / ``chunk``): each piece straddles ranks, so every step gathers the
output whole first (all-gather forward, its dual backward) and what follows runs replicated.
`watch_fused_splits` (called by ``sf.parallel.apply``) watches the first forward of each such
layer and warns, naming the rule and the fix. `warn_narrow_splits` warns, before any step, of a
projection that widens (``out > in``, as ``c_fc``) split by its input features: its partial
output, wider than its input, is reduced every forward (`feature_axes`: which axis of a weight is
which, ``nn.Linear`` ``(out, in)``, HF ``Conv1D`` ``(in, out)``). See docs/torch_models.md.
"""

from __future__ import annotations

import re
import warnings
from typing import Mapping, NamedTuple

import torch

from .. import comm as _comm
from ..placement import Placement
from ..sbp import B, Split, format_nd_sbp
from ..tensor import GlobalTensor, watch_resplit
from .layers import Conv2d, Embedding, Linear
from .modules import Module

__all__ = ["watch_fused_splits", "warn_narrow_splits", "feature_axes", "CostlyLayoutWarning"]


class CostlyLayoutWarning(UserWarning):
    """A layout that is valid but moves much more data than another would."""


class FeatureAxes(NamedTuple):
    """Which axis of a projection's 2-D weight holds its output and its input features."""

    out: int
    inp: int


def _is_hf_conv1d(m) -> bool:
    """transformers' ``Conv1D`` (GPT-2, GPT): a linear layer whose weight is ``(in, out)``;
    recognised by name and attributes (sbpflow does not import transformers)."""
    return any(c.__name__ == "Conv1D" for c in type(m).__mro__) and hasattr(m, "nf") and \
        hasattr(m, "nx")


def feature_axes(m) -> FeatureAxes | None:
    """The feature axes of module ``m``'s ``weight``: ``nn.Linear`` / ``sf.nn.Linear``
    ``(out, in)``, HF ``Conv1D`` ``(in, out)``, ``nn.Embedding`` ``(num, dim)`` (its rows are
    the inputs it looks up), a convolution ``(out, in / groups, *kernel)`` (transposed:
    ``(in, out / groups, ...)``); None for any other module."""
    if isinstance(m, (Linear, torch.nn.Linear, Conv2d)):
        return FeatureAxes(0, 1)
    if isinstance(m, torch.nn.modules.conv._ConvNd):
        return FeatureAxes(1, 0) if m.transposed else FeatureAxes(0, 1)
    if _is_hf_conv1d(m):
        return FeatureAxes(1, 0)
    if isinstance(m, (Embedding, torch.nn.Embedding)):
        return FeatureAxes(1, 0)
    return None


def _split_dims(nd: tuple, placement: Placement, axis: int) -> list[int]:
    return [d for d, s in enumerate(nd)
            if isinstance(s, Split) and s.axis == axis and placement.shape[d] > 1]


def watch_fused_splits(model: Module, placement: Placement,
                       layouts: Mapping[str, tuple]) -> int:
    """Watch the first forward of every projection (`feature_axes`: ``Linear``, HF ``Conv1D``)
    whose weight ``layouts`` (parameter name -> nd-sbp on ``placement``) splits by output
    features: if the model cuts that output with
    ``split`` / ``chunk`` along its last axis, warn (`CostlyLayoutWarning`, on the placement's
    first rank) with the fix. Returns the number of layers watched."""
    watched = 0
    for mod_name, m in model.named_modules():
        axes = feature_axes(m)
        w = m._parameters.get("weight") if axes is not None else None
        if w is None or w.ndim != 2 or isinstance(m, (Embedding, torch.nn.Embedding)):
            continue   # projections only: Linear, HF Conv1D
        name = f"{mod_name}.weight" if mod_name else "weight"
        nd = layouts.get(name)
        if nd is None or not _split_dims(tuple(nd), placement, axes.out):
            continue
        _watch(m, mod_name or type(m).__name__, tuple(nd), placement, axes.out)
        watched += 1
    return watched


def _watch(m: Module, name: str, nd: tuple, placement: Placement, out_axis: int) -> None:
    def hook(module, args, out):
        handle.remove()
        if isinstance(out, GlobalTensor):
            watch_resplit(out, lambda t, dim: _check(t, dim, name, nd, placement, out_axis))
    handle = m.register_forward_hook(hook)


def _check(t: GlobalTensor, dim: int, name: str, nd: tuple, placement: Placement,
           out_axis: int) -> None:
    last = t.ndim - 1
    if dim % max(t.ndim, 1) != last or _comm.rank() != placement.flat_ranks[0]:
        return
    if not any(isinstance(s, Split) and s.axis == last for s in t.sbp):
        return
    cut = _split_dims(nd, placement, out_axis)
    kept = tuple(B if d in cut else s for d, s in enumerate(nd))
    rule = re.sub(r"\.\d+(?=\.|$)", ".*", name)   # one message for every layer of a stack
    warnings.warn(
        f"sf.parallel.apply: {rule}.weight is laid out {format_nd_sbp(nd)} on {placement}, "
        f"which splits its output features across ranks, and the model cuts its output into "
        f"pieces along that axis (split / chunk: a fused projection such as attention's "
        f"[q | k | v]). Each piece straddles ranks, so every step moves the whole output "
        f"first (an all-gather or all-to-all forward, its dual backward) before the layers "
        f"after it. Fix: keep it unsplit there (a rule '{rule}.*': {format_nd_sbp(kept)}), "
        f"or order its output features so that each rank's block holds whole pieces (for "
        f"attention, per head [q_h | k_h | v_h]) and cut it per head with a reshape to (..., "
        f"heads, 3, head_dim); see docs/torch_models.md, 'Costly layouts'",
        CostlyLayoutWarning, stacklevel=2)


def warn_narrow_splits(model: Module, placement: Placement, layouts: Mapping[str, tuple],
                       who: str = "sf.parallel.apply") -> int:
    """Warn (`CostlyLayoutWarning`, on the placement's first rank) of each projection
    (`feature_axes`) whose weight ``layouts`` split by input features although it widens
    (``out > in``): every forward then reduces its partial output (all-reduce or
    reduce-scatter of ``out`` features a token) where splitting the output features
    (``sf.parallel.colwise``) would communicate no more than its narrower input. The usual
    cause: ``nn.Linear``'s axes used on a HF ``Conv1D``, stored transposed. Returns the count."""
    warned = 0
    for mod_name, m in model.named_modules():
        axes = feature_axes(m)
        w = m._parameters.get("weight") if axes is not None else None
        nd = layouts.get(f"{mod_name}.weight" if mod_name else "weight")
        if w is None or nd is None or w.ndim != 2 or isinstance(m, (Embedding, torch.nn.Embedding)):
            continue
        n_out, n_in = w.shape[axes.out], w.shape[axes.inp]
        if n_out <= n_in or not _split_dims(tuple(nd), placement, axes.inp):
            continue
        warned += 1
        if _comm.rank() == placement.flat_ranks[0]:
            warnings.warn(_narrow_message(who, mod_name or type(m).__name__, m, tuple(w.shape),
                                          tuple(nd), placement, axes), CostlyLayoutWarning,
                          stacklevel=3)
    return warned


def _narrow_message(who: str, name: str, m, shape: tuple, nd: tuple, placement: Placement,
                    axes: FeatureAxes) -> str:
    kind = "HF Conv1D, stored (in, out)" if _is_hf_conv1d(m) else \
        f"{type(m).__name__}, stored (out, in)"
    n_out, n_in = shape[axes.out], shape[axes.inp]
    better = tuple(Split(axes.out) if isinstance(s, Split) and s.axis == axes.inp else s
                   for s in nd)
    return (f"{who}: {name}.weight ({kind}: {shape}) is laid out {format_nd_sbp(nd)} on "
            f"{placement}, which splits its {n_in} input features: each forward then reduces "
            f"its partial output of {n_out} features a token ({n_out / n_in:g}x its input's "
            f"bytes) and the layer after it gets it whole. Cheaper: split its output features, "
            f"the rule '{name}.*': sf.parallel.colwise (here weight {format_nd_sbp(better)}, "
            f"bias split alike); if the input features were meant, the layer is the second of "
            f"a column / row pair (sf.parallel.rowwise) only where it narrows")
