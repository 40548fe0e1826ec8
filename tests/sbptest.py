"""Helpers shared by the tests: all sbps of a tensor, global tensors with real partial values."""

from __future__ import annotations

import itertools

import torch

import sbpflow as sf
from sbpflow.sbp import Partial, Split, shard_box


def sbps_1d(ndim: int, partial_ops=("sum",)) -> list:
    """Every 1-D sbp of a tensor with ``ndim`` dims."""
    return [sf.S(a) for a in range(ndim)] + [sf.B] + [sf.P(op) for op in partial_ops]


def nd_sbps(ndim: int, mesh_ndim: int, partial_ops=("sum",)) -> list[tuple]:
    return list(itertools.product(sbps_1d(ndim, partial_ops), repeat=mesh_ndim))


def int_tensor(shape, seed: int, dtype=torch.float64, low=-50, high=50) -> torch.Tensor:
    """Integer-valued floats: sums of them are exact, so partial layouts compare exactly."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, tuple(shape), generator=g).to(dtype)


def make_global(full: torch.Tensor, placement, nd_sbp, seed: int = 0) -> "sf.GlobalTensor":
    """A global tensor with logical value ``full`` whose partial dims hold genuinely different
    parts on each rank (not just the value on one rank and zeros), built from local shards.

    For ``P(sum)`` the parts are integers summing exactly to the value; for ``P(max)`` /
    ``P(min)`` the other ranks hold values below / above it.
    """
    nd = sf.parse_nd_sbp(nd_sbp, placement.ndim)
    me = sf.rank()
    shape = tuple(full.shape)
    if me not in placement:
        return sf.from_local(torch.empty(0, dtype=full.dtype), placement, nd, shape=shape)
    coord = placement.coord_of(me)
    box = shard_box(shape, placement.shape, nd, coord)
    value = full[tuple(slice(s, s + n) for s, n in box)]
    pdims = [d for d, s in enumerate(nd) if isinstance(s, Partial)]
    if not pdims:
        return sf.from_local(value.clone(), placement, nd, shape=shape)
    op = nd[pdims[0]].op
    sizes = [placement.shape[d] for d in pdims]
    members = list(itertools.product(*(range(n) for n in sizes)))
    j = members.index(tuple(coord[d] for d in pdims))
    key = hash((box, seed)) % (1 << 31)

    def noise(k):
        return int_tensor(value.shape, key + 7919 * k, value.dtype, 0, 20)

    if op == "sum":
        local = value - sum((noise(k) for k in range(1, len(members))), torch.zeros_like(value)) \
            if j == 0 else noise(j)
    elif op == "max":
        local = value.clone() if j == 0 else value - noise(j)
    else:
        local = value.clone() if j == 0 else value + noise(j)
    return sf.from_local(local, placement, nd, shape=shape)


def random_local(shape, placement, nd_sbp, seed: int, dtype=torch.float64) -> "sf.GlobalTensor":
    """A global tensor whose shards are arbitrary random values (replicas need not agree):
    boxing is linear on the shards, so adjoint identities hold for any of them."""
    nd = sf.parse_nd_sbp(nd_sbp, placement.ndim)
    me = sf.rank()
    if me not in placement:
        return sf.from_local(torch.empty(0, dtype=dtype), placement, nd, shape=tuple(shape))
    lshape = sf.sbp.local_shape(shape, placement.shape, nd, placement.coord_of(me))
    g = torch.Generator().manual_seed(seed * 1009 + me)
    return sf.from_local(torch.randn(lshape, generator=g, dtype=dtype), placement, nd,
                         shape=tuple(shape))


def splits_only(nd) -> bool:
    return all(isinstance(s, Split) for s in nd)
