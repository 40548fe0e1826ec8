"""Ops that pick entries along one axis: ``max_dim`` / ``min_dim`` (values and indices),
``sort``, ``topk``, ``kthvalue``, ``median_dim``, ``mode``, ``cummax``, ``cummin``, ``argmax``,
``argmin``.

Each runs torch's kernel on the local shard with the axis it works along whole on the rank:
that axis is never split (the dispatch gathers it first), the other axes keep their split, and
no partial value passes (picking is not linear). The indices are then the logical ones along
the axis; they are int64 and carry no gradient, as in torch. Without ``dim`` (``argmax`` of the
whole tensor) the input is replicated first. See docs/torch_models.md, 'Values and indices'.
"""

from __future__ import annotations

import torch

from .registry import Signature, TensorMeta, register

__all__ = ["SELECTIONS", "along_signatures"]


def _norm(dim: int, ndim: int) -> int:
    n = max(ndim, 1)
    if not -n <= dim < n:
        raise IndexError(f"dim {dim} is out of range for a tensor with {ndim} dimension(s)")
    return dim % n


def along_signatures(outputs: int, keeps_axis: bool):
    """The signature generator of an op along ``dim`` with ``outputs`` outputs of one shape:
    ``S(a) -> S(b)`` for every axis ``a`` but ``dim`` (``b`` shifts down past a removed
    ``dim``; ``keeps_axis`` or ``keepdim`` keep it), and all ``B``."""

    def signatures(x: TensorMeta, dim=None, keepdim: bool = False, **_) -> list[Signature]:
        sigs = []
        if dim is not None and x.ndim:
            d = _norm(dim, x.ndim)
            kept = keeps_axis or keepdim
            for a in range(x.ndim):
                if a != d and x.shape[a] > 1:
                    b = a if kept or a < d else a - 1
                    sigs.append(Signature([f"S({a})"], [f"S({b})"] * outputs))
        sigs.append(Signature(["B"], ["B"] * outputs))
        return sigs

    return signatures


def _pair(fn):
    """A kernel returning torch's (values, indices) structure as a plain tuple."""
    def kernel(x, *args, **kwargs):
        return tuple(fn(x, *args, **kwargs))
    return kernel


# name -> (kernel, outputs, keeps the axis)
SELECTIONS = {
    "max_dim": (_pair(lambda x, dim, keepdim=False: torch.max(x, dim, keepdim)), 2, False),
    "min_dim": (_pair(lambda x, dim, keepdim=False: torch.min(x, dim, keepdim)), 2, False),
    "median_dim": (_pair(lambda x, dim, keepdim=False: torch.median(x, dim, keepdim)), 2, False),
    "mode": (_pair(lambda x, dim, keepdim=False: torch.mode(x, dim, keepdim)), 2, False),
    "kthvalue": (_pair(lambda x, k, dim, keepdim=False: torch.kthvalue(x, k, dim, keepdim)),
                 2, False),
    "sort": (_pair(lambda x, dim, descending=False, stable=False:
                   torch.sort(x, dim=dim, descending=descending, stable=stable)), 2, True),
    "topk": (_pair(lambda x, k, dim, largest=True, sorted=True:
                   torch.topk(x, k, dim, largest, sorted)), 2, True),
    "cummax": (_pair(lambda x, dim: torch.cummax(x, dim)), 2, True),
    "cummin": (_pair(lambda x, dim: torch.cummin(x, dim)), 2, True),
    "argmax": (lambda x, dim=None, keepdim=False: torch.argmax(x, dim, keepdim), 1, False),
    "argmin": (lambda x, dim=None, keepdim=False: torch.argmin(x, dim, keepdim), 1, False),
}

for _name, (_kernel, _outputs, _keeps) in SELECTIONS.items():
    register(_name, _kernel, along_signatures(_outputs, _keeps),
             doc=f"{_name} along dim (whole on each rank; other axes keep their split)")
