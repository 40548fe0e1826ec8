"""Reductions: ``sum``, ``mean``, ``amax``, ``amin`` over ``dim`` (an int, a tuple, or ``None``
= every axis; as in torch, an empty tuple also means every axis), with ``keepdim``.

A split axis that is reduced gives a partial output (``P`` for sum / mean, a detached
``P(max/min)`` for amax / amin); ``mean`` then divides by the LOGICAL count. See
docs/internals.md, 'Reduction signatures'.
"""

from __future__ import annotations

import math

import torch

from ..errors import SignatureError
from ..sbp import Split
from .registry import Signature, TensorMeta, register

__all__ = ["reduced_dims", "reduce_signatures", "REDUCTIONS"]


def reduced_dims(dim, ndim: int) -> tuple[int, ...]:
    """The reduced axes, non-negative and sorted (``None`` or ``()``: all of them)."""
    if dim is None:
        return tuple(range(ndim))
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    if not dims:
        return tuple(range(ndim))
    n = max(ndim, 1)
    out = set()
    for d in dims:
        if not -n <= d < n:
            raise IndexError(f"dim {d} is out of range for a tensor with {ndim} dimension(s)")
        out.add(d % n)
    return tuple(sorted(a for a in out if a < ndim))


def reduce_signatures(partial: str):
    """The signature generator of a reduction whose split reduced axis gives ``partial``."""

    def signatures(x: TensorMeta, dim=None, keepdim: bool = False) -> list[Signature]:
        red = reduced_dims(dim, x.ndim)
        sigs = []
        for a in range(x.ndim):
            if a in red:
                sigs.append(Signature([f"S({a})"], [partial]))
            else:
                b = a if keepdim else a - sum(r < a for r in red)
                sigs.append(Signature([f"S({a})"], [f"S({b})"]))
        sigs.append(Signature([partial], [partial]))  # P -> P, P(max) -> P(max), P(min) -> P(min)
        sigs.append(Signature(["B"], ["B"]))
        return sigs

    return signatures


def _torch_dim(dim):
    return () if dim is None else dim


def _sum(x, dim=None, keepdim=False):
    return torch.sum(x, dim=dim, keepdim=keepdim)


def _mean(x, dim=None, keepdim=False, ctx=None):
    """Mean; with a reduced axis split, the local sum over the logical count (a partial)."""
    if ctx is not None:
        red = reduced_dims(dim, x.ndim)
        if any(isinstance(s, Split) and s.axis in red for s in ctx.ins[0]):
            if not ctx.in_shapes:
                raise SignatureError("mean over a split axis needs the logical input shape "
                                     "(KernelContext.in_shapes), which the caller did not give")
            shape = ctx.in_shapes[0]
            count = math.prod(shape[a] for a in red)
            if x.dtype in (torch.float16, torch.bfloat16):  # sum in float32, as torch.mean does
                return (torch.sum(x, dim=dim, keepdim=keepdim, dtype=torch.float32)
                        / count).to(x.dtype)
            return torch.sum(x, dim=dim, keepdim=keepdim) / count
    return torch.mean(x, dim=dim, keepdim=keepdim)


def _amax(x, dim=None, keepdim=False):
    return torch.amax(x, dim=_torch_dim(dim), keepdim=keepdim)


def _amin(x, dim=None, keepdim=False):
    return torch.amin(x, dim=_torch_dim(dim), keepdim=keepdim)


REDUCTIONS = {
    "sum": (_sum, "P", False),
    "mean": (_mean, "P", True),
    "amax": (_amax, "P(max)", False),
    "amin": (_amin, "P(min)", False),
}

for _name, (_kernel, _partial, _context) in REDUCTIONS.items():
    register(_name, _kernel, reduce_signatures(_partial), context=_context,
             doc=f"{_name} over dim (int, tuple or None), keepdim; a split reduced axis gives "
                 f"{_partial}")
