"""``clip_grad_norm_`` over global parameters in any mix of layouts.

Each gradient is boxed to its parameter's layout (the boxing the optimizer needs anyway: the
result is remembered, so the following ``step`` does not reduce the gradient again). In that
layout every logical element has one owner per replica group: a rank counts its shard iff it is
the first rank along every mesh dim that replicates the tensor (``B``); split dims each count
their part. The per-rank sums of ``|g|^p`` then meet in one scalar all-reduce over the world (a
``P`` scalar read with ``.item()``), whatever the number of parameters and layouts.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

from .. import comm as _comm
from ..errors import GraphError
from ..placement import Placement
from ..sbp import B, Broadcast, Partial
from ..tensor import GlobalTensor, from_local, recording
from .boxed_grads import _remember, boxed_grads

__all__ = ["clip_grad_norm_", "grad_norm", "clip_groups"]


def _counts_once(t: GlobalTensor) -> bool:
    pl = t.placement
    me = _comm.rank()
    if me not in pl:
        return False
    coord = pl.coord_of(me)
    return all(c == 0 for s, c in zip(t.sbp, coord) if isinstance(s, Broadcast))


def _world_scalar(value: float, op: str, device_type: str) -> float:
    world = Placement(device_type, list(range(_comm.world_size())))
    t = from_local(torch.tensor(value, dtype=torch.float64), world, Partial(op), shape=())
    return t.item()


def _grads(parameters) -> list[tuple[GlobalTensor, GlobalTensor]]:
    if recording():   # (the trace records backward, not runs it: no gradient to read yet)
        raise GraphError("graph: build clips or measures gradients (clip_grad_norm_ / "
                         "grad_norm), but a graph runs backward after build, so they are not "
                         "there yet. Clip in the optimizer's update instead: give its "
                         "parameter group 'clip_grad_max_norm' (and 'clip_grad_norm_type', "
                         "default 2), as OneFlow's graphs do")
    if isinstance(parameters, GlobalTensor):
        parameters = [parameters]
    parameters = list(parameters)
    return [(p, g) for p, g in zip(parameters, boxed_grads(parameters, remember=True))
            if g is not None]


def grad_norm(parameters: Iterable[GlobalTensor] | GlobalTensor, norm_type: float = 2.0) -> float:
    """The ``norm_type``-norm of all gradients together (their logical values), on every rank."""
    return _norm(_grads(parameters), float(norm_type))


def _norm(pairs, norm_type: float) -> float:
    if not pairs:
        return 0.0
    device_type = pairs[0][0].placement.device_type
    inf = math.isinf(norm_type)
    acc = 0.0
    for p, g in pairs:
        if any(isinstance(s, Partial) for s in g.sbp):  # a partial-sum parameter: reduce first
            g = g.to_global(sbp=tuple(B if isinstance(s, Partial) else s for s in g.sbp))
        if not _counts_once(g) or g.local.numel() == 0:
            continue
        local = g.local.detach().to(torch.float64).abs()
        if inf:
            acc = max(acc, float(local.max()))
        elif norm_type == 0:
            acc += float((local != 0).sum())
        else:
            acc += float(local.pow(norm_type).sum())
    total = _world_scalar(acc, "max" if inf else "sum", device_type)
    if inf or norm_type == 0:
        return total
    return total ** (1.0 / norm_type)


def clip_grad_norm_(parameters: Iterable[GlobalTensor] | GlobalTensor, max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach=None) -> torch.Tensor:
    """Scale the gradients so that their joint norm is at most ``max_norm``, as
    ``torch.nn.utils.clip_grad_norm_`` (coefficient ``max_norm / (norm + 1e-6)`` clamped to 1).
    Returns the norm before clipping as a 0-d torch tensor, the same on every rank. Every rank
    must call it (collectives)."""
    pairs = _grads(parameters)
    if not pairs:
        return torch.tensor(0.0)
    norm_type = float(norm_type)
    total = _norm(pairs, norm_type)
    dtype = pairs[0][1].dtype
    total_t = torch.tensor(total, dtype=dtype)
    if error_if_nonfinite and not math.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} for gradients is non-finite, "
                           f"so it cannot be clipped; set error_if_nonfinite=False to skip this")
    coef = torch.clamp(torch.tensor(float(max_norm), dtype=dtype) / (total_t + 1e-6), max=1.0)
    with torch.no_grad():
        for p, g in pairs:
            raw = p.local.grad
            raw.mul_(coef.to(raw.dtype))
            shares = g.local.numel() > 0 and raw.numel() > 0 and \
                g.local.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr()
            if not shares:
                g.local.mul_(coef.to(g.local.dtype))
            _remember(p, g)
    return total_t


def clip_groups(groups: list[dict]) -> None:
    """`clip_grad_norm_` of each parameter group that names ``clip_grad_max_norm`` (and
    optionally ``clip_grad_norm_type``, default 2), over that group's parameters, as OneFlow's
    optimizers do: the optimizer's `step` calls it first, so clipping works in graph mode, where
    ``build`` cannot read gradients."""
    for group in groups:
        max_norm = group.get("clip_grad_max_norm")
        if max_norm is not None:
            clip_grad_norm_(group["params"], max_norm, group.get("clip_grad_norm_type", 2.0))
