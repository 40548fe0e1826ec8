"""Plain torch tensors mixed with global ones: a plain tensor among an op's arguments is taken
as replicated on the placement of the global tensors beside it (`lift`); `lift_arguments` /
`lifting_plain_tensors` do so for the arguments of a function of global tensors (a mask, a
target, positions). The dispatch lifts an op's arguments when no signature takes them plain.
"""

from __future__ import annotations

import functools

import torch

from .. import comm as _comm
from ..boxing import empty_local
from ..errors import UnsupportedTorchFunction
from ..placement import Placement
from ..sbp import B
from ..utils import rebuild_sequence
from .global_tensor import GlobalTensor, _device
from .hooks import _tracing

__all__ = ["lift", "lift_arguments", "lifting_plain_tensors"]


def lift(value: torch.Tensor, placement: Placement) -> GlobalTensor:
    """A plain torch tensor taken as replicated on ``placement`` (every rank of it holds the
    whole value, which must be the same on every rank: a mask, positions, a constant); in a
    graph's build, a constant of the graph. One that requires grad (a torch parameter left in
    a model) is refused: convert the model."""
    if value.requires_grad:
        raise UnsupportedTorchFunction(
            f"a plain torch tensor of shape {tuple(value.shape)} that requires grad (a torch "
            f"parameter?) is mixed with global tensors on {placement}; convert its module with "
            f"sf.nn.from_torch (or sf.parallel.apply), or wrap it with sf.tensor / "
            f"sf.nn.Parameter")
    device = _device(placement)
    if value.is_meta:  # made on an input's device while sf.auto.trace runs on shapes
        device = value.device
    local = value.to(device) if _comm.rank() in placement else \
        empty_local(value.dtype, device)
    out = GlobalTensor(local, tuple(value.shape), placement, (B,) * placement.ndim)
    if _tracing.recorder is not None:  # a graph constant, as sf.tensor(value) in build is
        _tracing.recorder.constant(out)
    return out


def lift_arguments(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with each plain torch tensor, also inside a list or tuple,
    lifted (`lift`) onto the placement of the first global tensor among them; unchanged when
    there is none of either. What a torch function or an ``sf.nn.functional`` function does
    with a mask, a target or positions given as plain torch tensors."""
    if not any(_holds_plain(a) for a in (*args, *kwargs.values())):
        return args, kwargs
    pl = next((t._placement for a in (*args, *kwargs.values()) for t in _members(a)
               if isinstance(t, GlobalTensor)), None)
    if pl is None:
        return args, kwargs
    return (tuple(_lifted(a, pl) for a in args),
            {k: _lifted(v, pl) for k, v in kwargs.items()})


def lifting_plain_tensors(fn):
    """``fn`` (a function of global tensors, e.g. ``sf.nn.functional.cross_entropy``) taking
    plain torch tensors among its arguments too, lifted by `lift_arguments`."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        args, kwargs = lift_arguments(args, kwargs)
        return fn(*args, **kwargs)
    return wrapper


def _members(value) -> tuple:
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def _holds_plain(value) -> bool:
    return any(isinstance(v, torch.Tensor) for v in _members(value))


def _lifted(value, pl: Placement):
    if isinstance(value, (list, tuple)):
        if not _holds_plain(value):
            return value
        return rebuild_sequence(value, [_lifted(v, pl) for v in value])
    return lift(value, pl) if isinstance(value, torch.Tensor) else value


def _lift_args(args: tuple) -> tuple | None:
    """``args`` with each plain torch tensor lifted (`lift`) onto the placement of the first
    global tensor; None when there is nothing to lift."""
    pl = next((a._placement for a in args if isinstance(a, GlobalTensor)), None)
    if pl is None or not any(isinstance(a, torch.Tensor) for a in args):
        return None
    return tuple(lift(a, pl) if isinstance(a, torch.Tensor) else a for a in args)
