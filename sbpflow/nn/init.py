"""``sf.nn.init``: torch.nn.init's names on global tensors, filled in place.

Every fill is *layout-independent*: the values are a function of the logical index and a seed
only, so the same seed gives the same logical values whatever the placement and sbp, and each
rank computes only its own shard. Under ``meta_init()`` fills are recorded instead, and
`materialize` / `materialize_` later build such tensors in any layout with the same values.
See docs/internals.md, 'Initialisation'.
"""

from __future__ import annotations

import math
import threading
from contextlib import contextmanager
from typing import Iterator

import torch

from .. import comm as _comm
from ..errors import ShapeError
from ..placement import Placement
from ..sbp import check_axes, holds_value, local_shape, parse_nd_sbp, shard_box
from ..tensor import GlobalTensor, _next_seed, zeros as _zeros
from ..random_regions import generate_region
from .parameter import Parameter
from .recipes import _RECIPES_LOCK, _recipe, copy_record, record

__all__ = ["uniform_", "normal_", "constant_", "zeros_", "ones_", "xavier_uniform_",
           "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "calculate_gain",
           "fan_in_and_fan_out", "meta_init", "is_meta_init", "meta_tensor", "is_meta",
           "record", "copy_record", "materialize", "materialize_"]


# -- building without memory ------------------------------------------------------------------
class _MetaState(threading.local):
    depth = 0   # a class default; per thread: each rank thread of the threads backend has its own


_META = _MetaState()


@contextmanager
def meta_init() -> Iterator[None]:
    """Build ``sf.nn`` modules without allocating their parameters (on the calling rank).

    Inside, layers create parameters whose local shards are ``meta`` tensors of the right
    shape and dtype, and initialisers record their fills (`record`) instead of running them.
    Nothing communicates. Give the parameters storage with `materialize_` (in their own
    layouts) or ``sf.auto.parallelize`` (in the chosen ones); `sf.auto.trace` works on the
    meta model as it is. Nests; every rank must enter it around the same construction."""
    _META.depth += 1
    try:
        yield
    finally:
        _META.depth -= 1


def is_meta_init() -> bool:
    """Whether the calling rank is inside `meta_init`."""
    return _META.depth > 0


def is_meta(tensor: GlobalTensor) -> bool:
    """Whether ``tensor`` has no storage (its shard is a ``meta`` tensor)."""
    return tensor.local.is_meta


def meta_tensor(shape, placement: Placement | None = None, sbp=None,
                dtype: torch.dtype | None = None) -> GlobalTensor:
    """A global tensor of logical ``shape`` laid out as (``placement``, ``sbp``) (defaults as
    the creation ops: every rank, replicated) whose shard is a storage-less ``meta`` tensor
    of this rank's shard shape (empty outside the placement)."""
    shape = tuple(int(n) for n in shape)
    world = _comm.world_size()
    if placement is None:
        placement = Placement("cpu", list(range(world)))
    placement.check_world(world)
    nd = parse_nd_sbp(sbp if sbp is not None else ("B",) * placement.ndim, placement.ndim)
    check_axes(nd, len(shape), shape=shape, placement=placement)
    me = _comm.rank()
    local_sz = local_shape(shape, placement.shape, nd, placement.coord_of(me)) \
        if me in placement else (0,)
    local = torch.empty(local_sz, dtype=dtype or torch.get_default_dtype(), device="meta")
    return GlobalTensor(local, shape, placement, nd)


def materialize(tensor: GlobalTensor, placement: Placement | None = None,
                sbp=None) -> GlobalTensor:
    """A tensor with storage, of ``tensor``'s logical shape and dtype, laid out as
    (``placement``, ``sbp``) (default: ``tensor``'s own layout), holding the values its
    recorded initialisation gives (zeros without a recipe). A tensor that already has storage
    is returned boxed to that layout (a collective) instead. Layout-independent: the values do
    not depend on the layout, and each rank computes only its own shard."""
    placement = tensor.placement if placement is None else placement
    if sbp is None:
        if placement.ndim != tensor.placement.ndim:
            raise ShapeError(f"materialize: a tensor of shape {tuple(tensor.shape)} with sbp "
                             f"{tensor.sbp} on {tensor.placement} needs sbp= for {placement}")
        sbp = tensor.sbp
    if not is_meta(tensor):
        return tensor.detach().to_global(placement, sbp)
    out = _zeros(*tuple(tensor.shape), placement=placement, sbp=sbp, dtype=tensor.dtype)
    with _RECIPES_LOCK:
        steps = list(_recipe(tensor) or ())
    for step in steps:
        step(out)
    return out


def materialize_(module) -> object:
    """Give every meta parameter of ``module`` (an ``sf.nn.Module``) storage in its own layout,
    re-registered as a fresh leaf parameter under each of its names (tied stay tied); returns
    ``module``. Build the optimizer afterwards."""
    new: dict = {}
    for m in module.modules():
        for key, p in list(m._parameters.items()):
            if p is None or not is_meta(p):
                continue
            if id(p) not in new:
                new[id(p)] = Parameter(materialize(p), requires_grad=p.requires_grad)
            m._parameters[key] = new[id(p)]
    return module


def fill_regions_(tensor: GlobalTensor, make) -> GlobalTensor:
    """Write ``make(box)`` (the logical values of region ``box``) into this rank's shard, in
    place (a rank that does not hold a partial layout's value gets zeros: `sbp.holds_value`);
    on a meta tensor, record the fill for `materialize`."""
    if not isinstance(tensor, GlobalTensor):
        raise TypeError(f"sf.nn.init works on sf.GlobalTensor, got {type(tensor).__name__}")
    if tensor.local.is_meta:   # built under meta_init: remember the fill, compute nothing
        record(tensor, lambda t: fill_regions_(t, make))
        return tensor
    pl, nd = tensor.placement, tensor.sbp
    me = _comm.rank()
    if me not in pl:
        return tensor
    coord = pl.coord_of(me)
    box = shard_box(tuple(tensor.shape), pl.shape, nd, coord)
    local = tensor.local
    with torch.no_grad():
        if not holds_value(nd, coord):
            local.zero_()
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
    return fill_regions_(tensor, lambda box: a + (b - a) * region(box))


def normal_(tensor: GlobalTensor, mean: float = 0.0, std: float = 1.0, *, seed: int | None = None,
            generator: torch.Generator | None = None) -> GlobalTensor:
    """Fill with values drawn from ``N(mean, std²)``."""
    region = _rand_region("randn", tensor, seed, generator)
    return fill_regions_(tensor, lambda box: mean + std * region(box))


def constant_(tensor: GlobalTensor, val: float) -> GlobalTensor:
    """Fill with ``val``, in place, in the tensor's layout (a ``P`` tensor: the rank that holds
    the value gets ``val``, the others zeros)."""
    return fill_regions_(tensor, lambda box: torch.full(tuple(n for _, n in box), float(val),
                                                        dtype=tensor.dtype))


def zeros_(tensor: GlobalTensor) -> GlobalTensor:
    """``constant_(tensor, 0.0)``."""
    return constant_(tensor, 0.0)


def ones_(tensor: GlobalTensor) -> GlobalTensor:
    """``constant_(tensor, 1.0)``."""
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
    """torch's ``xavier_uniform_``: uniform on ``[-a, a]``, ``a = gain * sqrt(6 / (fan_in +
    fan_out))``, the same logical values in every layout (``seed=`` / ``generator=`` as
    `uniform_`)."""
    fan_in, fan_out = fan_in_and_fan_out(tensor.shape)
    a = math.sqrt(3.0) * gain * math.sqrt(2.0 / float(fan_in + fan_out))
    return uniform_(tensor, -a, a, **seeding)


def xavier_normal_(tensor: GlobalTensor, gain: float = 1.0, **seeding) -> GlobalTensor:
    """torch's ``xavier_normal_``: ``N(0, std²)``, ``std = gain * sqrt(2 / (fan_in +
    fan_out))``."""
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
    """torch's ``kaiming_normal_``: ``N(0, std²)``, ``std = gain / sqrt(fan)`` (``mode`` picks
    fan_in or fan_out)."""
    std = calculate_gain(nonlinearity, a) / math.sqrt(_fan(tensor, mode))
    return normal_(tensor, 0.0, std, **seeding)
