"""``sf.nn.init``: torch.nn.init's names on global tensors, filled in place.

Every fill is *layout-independent*: the values are a function of the logical index and a seed
only (`sbpflow.utils.generate_region`), so a tensor initialised with the same seed holds the
same logical values whatever its placement and sbp, and each rank computes only its own shard.
Without ``seed=`` the seed comes from this rank's stream (`sf.manual_seed`), which agrees across
ranks as long as every rank initialises its tensors in the same order.

A tensor laid out with ``P(sum)`` keeps the value on the first rank of each partial group and
zeros elsewhere (``P(max)``/``P(min)``: the reduction's identity), as the creation ops do.
"""

from __future__ import annotations

import math

import torch

from .. import comm as _comm
from ..boxing import identity_value
from ..errors import ShapeError
from ..sbp import Partial, shard_box
from ..tensor import GlobalTensor, _next_seed
from ..utils import generate_region

__all__ = ["uniform_", "normal_", "constant_", "zeros_", "ones_", "xavier_uniform_",
           "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "calculate_gain",
           "fan_in_and_fan_out"]


def _fill(tensor: GlobalTensor, make) -> GlobalTensor:
    """Write ``make(box)`` (the logical values of region ``box``) into this rank's shard."""
    if not isinstance(tensor, GlobalTensor):
        raise TypeError(f"sf.nn.init works on sf.GlobalTensor, got {type(tensor).__name__}")
    pl, nd = tensor.placement, tensor.sbp
    me = _comm.rank()
    if me not in pl:
        return tensor
    coord = pl.coord_of(me)
    box = shard_box(tuple(tensor.shape), pl.shape, nd, coord)
    local = tensor.local
    with torch.no_grad():
        partial = [(s, c) for s, c in zip(nd, coord) if isinstance(s, Partial)]
        if any(c != 0 for _, c in partial):
            local.fill_(identity_value(partial[0][0].op, local.dtype))
        else:
            local.copy_(make(box).to(local.dtype).reshape(local.shape))
    return tensor


def _rand_region(kind: str, tensor: GlobalTensor, seed, generator):
    s = _next_seed(seed, generator)
    shape = tuple(tensor.shape)
    # drawn in float64 when the tensor is float64, else float32 (as generate_region does)
    dt = torch.float64 if tensor.dtype == torch.float64 else torch.float32
    return lambda box: generate_region(kind, shape, box, s, dt)


def uniform_(tensor: GlobalTensor, a: float = 0.0, b: float = 1.0, *, seed: int | None = None,
             generator: torch.Generator | None = None) -> GlobalTensor:
    """Fill with values drawn uniformly from ``[a, b)``."""
    region = _rand_region("rand", tensor, seed, generator)
    return _fill(tensor, lambda box: a + (b - a) * region(box))


def normal_(tensor: GlobalTensor, mean: float = 0.0, std: float = 1.0, *, seed: int | None = None,
            generator: torch.Generator | None = None) -> GlobalTensor:
    """Fill with values drawn from ``N(mean, std²)``."""
    region = _rand_region("randn", tensor, seed, generator)
    return _fill(tensor, lambda box: mean + std * region(box))


def constant_(tensor: GlobalTensor, val: float) -> GlobalTensor:
    return _fill(tensor, lambda box: torch.full(tuple(n for _, n in box), float(val)))


def zeros_(tensor: GlobalTensor) -> GlobalTensor:
    return constant_(tensor, 0.0)


def ones_(tensor: GlobalTensor) -> GlobalTensor:
    return constant_(tensor, 1.0)


def calculate_gain(nonlinearity: str, param=None) -> float:
    """torch.nn.init.calculate_gain."""
    return torch.nn.init.calculate_gain(nonlinearity, param)


def fan_in_and_fan_out(shape) -> tuple[int, int]:
    """(fan_in, fan_out) of a weight of logical ``shape``, as torch computes them."""
    shape = tuple(shape)
    if len(shape) < 2:
        raise ShapeError(f"fan in and fan out need a tensor with at least 2 dimensions, got "
                         f"shape {shape}")
    receptive = math.prod(shape[2:])
    return shape[1] * receptive, shape[0] * receptive


def _fan(tensor: GlobalTensor, mode: str) -> int:
    fan_in, fan_out = fan_in_and_fan_out(tensor.shape)
    if mode not in ("fan_in", "fan_out"):
        raise ValueError(f"mode {mode!r} not supported; use 'fan_in' or 'fan_out'")
    return fan_in if mode == "fan_in" else fan_out


def xavier_uniform_(tensor: GlobalTensor, gain: float = 1.0, **seeding) -> GlobalTensor:
    fan_in, fan_out = fan_in_and_fan_out(tensor.shape)
    a = math.sqrt(3.0) * gain * math.sqrt(2.0 / float(fan_in + fan_out))
    return uniform_(tensor, -a, a, **seeding)


def xavier_normal_(tensor: GlobalTensor, gain: float = 1.0, **seeding) -> GlobalTensor:
    fan_in, fan_out = fan_in_and_fan_out(tensor.shape)
    return normal_(tensor, 0.0, gain * math.sqrt(2.0 / float(fan_in + fan_out)), **seeding)


def kaiming_uniform_(tensor: GlobalTensor, a: float = 0.0, mode: str = "fan_in",
                     nonlinearity: str = "leaky_relu", **seeding) -> GlobalTensor:
    """torch's ``kaiming_uniform_``: bound ``gain * sqrt(3 / fan)``."""
    std = calculate_gain(nonlinearity, a) / math.sqrt(_fan(tensor, mode))
    bound = math.sqrt(3.0) * std
    return uniform_(tensor, -bound, bound, **seeding)


def kaiming_normal_(tensor: GlobalTensor, a: float = 0.0, mode: str = "fan_in",
                    nonlinearity: str = "leaky_relu", **seeding) -> GlobalTensor:
    std = calculate_gain(nonlinearity, a) / math.sqrt(_fan(tensor, mode))
    return normal_(tensor, 0.0, std, **seeding)
