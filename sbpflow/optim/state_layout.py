"""Optimizer state in the layout and dtype its update runs in (docs/zero.md, checkpoints).

State can be made before the layout it is used in is known: loaded (``load_state_dict``,
``sf.load``) before a graph's ``enable_zero`` takes effect at its first call, before
``sf.parallel.zero.shard``, or before a unit call gives a cast parameter its split update
layout. So the step compares, per parameter and without communication, each state tensor's
placement, nd-sbp and dtype with the update's (`conform`), and moves the ones that differ:
boxed (a cut of a whole tensor is a local slice) and cast, as torch's ``load_state_dict``
casts floating-point state to the parameter's dtype.
"""

from __future__ import annotations

import torch

from ..placement import Placement
from ..tensor import GlobalTensor

__all__ = ["conform", "cast_like"]


def cast_like(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` cast to ``dtype`` when both are floating point (torch's rule for loaded state;
    an integer entry stays as it is), else ``t``."""
    if t.dtype is not dtype and t.dtype.is_floating_point and dtype.is_floating_point:
        return t.to(dtype)
    return t


def _fits(v: GlobalTensor, placement: Placement, nd_sbp: tuple, dtype: torch.dtype) -> bool:
    """Whether state tensor ``v`` is in (``placement``, ``nd_sbp``) with ``dtype`` (or an
    entry that is not floating point, which keeps its dtype). Run per parameter and step:
    torch dtypes are singletons, so ``is`` decides the usual case."""
    have = v.shard.dtype
    if have is not dtype and have.is_floating_point and dtype.is_floating_point:
        return False
    return v.sbp == nd_sbp and (v.placement is placement or v.placement == placement)


def conform(state: dict, placement: Placement, nd_sbp: tuple, dtype: torch.dtype) -> None:
    """Put every global tensor of one parameter's ``state`` in the layout its update runs in
    (``placement``, ``nd_sbp``: the boxed gradient's) and, if floating point, in the
    parameter's ``dtype``: a comparison per entry, and for one that differs its boxing (a
    collective only where the new layout needs other ranks' data; every rank of the
    placement steps the same parameters in the same order, so they pair) and a contiguous
    copy (the fused kernels walk flat memory; the old tensor may be shared)."""
    for key, v in state.items():
        if isinstance(v, GlobalTensor) and not _fits(v, placement, nd_sbp, dtype):
            break
    else:
        return
    for key, v in list(state.items()):
        if not isinstance(v, GlobalTensor) or _fits(v, placement, nd_sbp, dtype):
            continue
        with torch.no_grad():
            moved = v.detach().to_global(placement, nd_sbp)
            local = cast_like(moved.local, dtype).clone(memory_format=torch.contiguous_format)
        state[key] = GlobalTensor(local, tuple(v.shape), placement, tuple(nd_sbp))
