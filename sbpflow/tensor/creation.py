"""Creation ops: global tensors made from their arguments alone (`randn`, `rand`, `zeros`,
`ones`, `full`, `arange`, `tensor`) or from each rank's shard (`from_local`).

Each rank computes only its own region of the logical value (`_create`), so the same
``seed`` gives the same logical tensor in any layout; without one, the seed comes from the
rank's stream (`manual_seed`), which agrees across ranks that create tensors in one order.
In a graph's build a tensor made here is a constant, and a random one is drawn again on
every replay (`fresh`).
"""

from __future__ import annotations

import math
import operator
from typing import Sequence

import torch

from .. import comm as _comm
from ..boxing import empty_local
from ..errors import DtypeMismatchError, ShapeError
from ..placement import Placement
from ..random_regions import generate_region, mix_seed
from ..sbp import SbpLike, format_nd_sbp, local_shape
from .global_tensor import GlobalTensor, _create, _device, _layout
from .methods import _shape_args
from .hooks import fresh

__all__ = ["randn", "rand", "zeros", "ones", "full", "arange", "tensor", "from_local",
           "manual_seed"]


def _norm_shape(shape) -> tuple[int, ...]:
    """The sizes ``*shape`` (or one sequence of them) as a tuple of ints. As torch, a size that
    is not an integer (6.5, '4', a nested tuple) or is negative is refused: `ShapeError`."""
    shape = _shape_args(shape)
    try:
        out = tuple(operator.index(s) for s in shape)
    except TypeError:  # int() would truncate 6.5 to 6 silently
        raise ShapeError(f"a shape is a sequence of ints, as in torch; got {tuple(shape)!r}") \
            from None
    if any(s < 0 for s in out):
        raise ShapeError(f"negative dimension in shape {out}")
    return out


def manual_seed(seed: int) -> None:
    """Seed this rank's stream of default seeds for creation ops (call it on every rank)."""
    state = _comm.current().per_rank
    state.seed = int(seed)
    state.seed_counter = 0


def _next_seed(seed: int | None, generator: torch.Generator | None) -> int:
    if seed is not None:
        return int(seed)
    if generator is not None:
        # Every rank's generator must be in the same state for the same logical tensor.
        return int(torch.randint(0, 1 << 62, (1,), generator=generator))
    state = _comm.current().per_rank
    k = state.seed_counter
    state.seed_counter = k + 1
    return mix_seed(state.seed, k)


def _random(kind: str, shape, placement, sbp, dtype, seed, generator, requires_grad):
    shape = _norm_shape(shape)
    dt = dtype or torch.get_default_dtype()
    if not (dt.is_floating_point or dt.is_complex):  # torch: "normal_kernel_cpu" not implemented
        raise DtypeMismatchError(f"sf.{kind}: random values of shape {shape} need a floating-point "
                                 f"dtype, as in torch; got {dt}")
    if seed is None and generator is None:  # a graph draws a new value on every replay
        return fresh(lambda: _random(kind, shape, placement, sbp, dtype, _next_seed(None, None),
                                     None, requires_grad))
    s = _next_seed(seed, generator)
    return _create(shape, placement, sbp, dt, requires_grad,
                   lambda box: generate_region(kind, shape, box, s, dt))


def randn(*shape, placement: Placement | None = None, sbp: SbpLike | None = None,
          dtype: torch.dtype | None = None, seed: int | None = None,
          generator: torch.Generator | None = None, requires_grad: bool = False) -> GlobalTensor:
    """Standard normal values; the same ``seed`` gives the same logical tensor in any layout.

    Without ``seed``/``generator`` the seed comes from this rank's stream (`manual_seed`), which
    agrees across ranks as long as they create tensors in the same order.
    """
    return _random("randn", shape, placement, sbp, dtype, seed, generator, requires_grad)


def rand(*shape, placement: Placement | None = None, sbp: SbpLike | None = None,
         dtype: torch.dtype | None = None, seed: int | None = None,
         generator: torch.Generator | None = None, requires_grad: bool = False) -> GlobalTensor:
    """Uniform values in [0, 1); same seeding rules as `randn`."""
    return _random("rand", shape, placement, sbp, dtype, seed, generator, requires_grad)


def full(shape, fill_value, *, placement: Placement | None = None, sbp: SbpLike | None = None,
         dtype: torch.dtype | None = None, requires_grad: bool = False) -> GlobalTensor:
    """A tensor filled with ``fill_value`` (a P layout: the first rank holds it, others 0)."""
    shape = _norm_shape((shape,))
    if dtype is None and isinstance(fill_value, bool):
        dtype = torch.bool
    elif dtype is None and isinstance(fill_value, int):
        dtype = torch.int64
    dtype = dtype or torch.get_default_dtype()
    # (made in its dtype: a float64 0.1 made in float32 first is 0.1 + 1.5e-9)
    return _create(shape, placement, sbp, dtype, requires_grad,
                   lambda box: torch.full(tuple(n for _, n in box), fill_value, dtype=dtype))


def zeros(*shape, placement: Placement | None = None, sbp: SbpLike | None = None,
          dtype: torch.dtype | None = None, requires_grad: bool = False) -> GlobalTensor:
    """A global tensor of zeros of ``shape`` laid out as ``sbp`` on ``placement`` (each rank
    makes its shard only; a ``P`` layout holds the zeros on every rank).

    >>> x = sf.zeros(4, 2, placement=sf.placement("cpu", ranks=[0]), sbp=sf.S(0))
    >>> x.shape, x.sbp
    (torch.Size([4, 2]), (S(0),))
    """
    return full(_norm_shape(shape), 0.0, placement=placement, sbp=sbp,
                dtype=dtype or torch.get_default_dtype(), requires_grad=requires_grad)


def ones(*shape, placement: Placement | None = None, sbp: SbpLike | None = None,
         dtype: torch.dtype | None = None, requires_grad: bool = False) -> GlobalTensor:
    """A global tensor of ones of ``shape`` laid out as ``sbp`` on ``placement`` (along a ``P``
    mesh dim the first rank holds the ones, the others zeros).

    >>> x = sf.ones(3, placement=sf.placement("cpu", ranks=[0]), sbp=sf.B)
    >>> x.full_tensor()
    tensor([1., 1., 1.])
    """
    return full(_norm_shape(shape), 1.0, placement=placement, sbp=sbp,
                dtype=dtype or torch.get_default_dtype(), requires_grad=requires_grad)


def arange(start, end=None, step=1, *, placement: Placement | None = None,
           sbp: SbpLike | None = None, dtype: torch.dtype | None = None,
           requires_grad: bool = False) -> GlobalTensor:
    """``torch.arange`` as a 1-D global tensor; each rank computes only its part."""
    if end is None:
        start, end = 0, start
    if step == 0 or (end - start) * step < 0:  # torch's RuntimeError: no such sequence
        raise ShapeError(f"arange(start={start}, end={end}, step={step}): the step must be "
                         f"nonzero and have the sign of end - start, as in torch")
    n = len(range(0, math.ceil((end - start) / step))) if step else 0
    ref = torch.arange(start, start + step, step, dtype=dtype)  # torch's dtype inference
    acc = torch.float64 if ref.dtype.is_floating_point else torch.int64

    def make(box):  # value i is start + i * step, computed as torch.arange does
        first, size = box[0]
        return start + step * torch.arange(first, first + size, dtype=acc)

    return _create((n,), placement, sbp, ref.dtype, requires_grad, make)


def tensor(data, placement: Placement | None = None, sbp: SbpLike | None = None, *,
           dtype: torch.dtype | None = None, requires_grad: bool = False) -> GlobalTensor:
    """A global tensor whose logical value is ``data`` (given on every rank); each rank keeps
    its shard."""
    full_value = torch.as_tensor(data, dtype=dtype)
    shape = tuple(full_value.shape)
    return _create(shape, placement, sbp, full_value.dtype, requires_grad,
                   lambda box: full_value[tuple(slice(s, s + n) for s, n in box)].clone())


def from_local(local: torch.Tensor, placement: Placement | None = None,
               sbp: SbpLike | None = None, shape: Sequence[int] | None = None, *,
               check: bool = False) -> GlobalTensor:
    """A global tensor from this rank's shard ``local`` (autograd flows through ``local``).

    Without ``shape`` the logical shape is inferred from all shards (one small all-gather of
    shapes among the placement's ranks), and shards that do not fit together raise
    `ShapeError`. With ``shape`` only this rank's shard is checked, unless ``check=True``.
    """
    if not isinstance(local, torch.Tensor):
        raise ShapeError(f"from_local needs a torch.Tensor, got {type(local).__name__}")
    ndim = len(shape) if shape is not None else local.dim()
    placement, nd = _layout(placement, sbp, ndim, tuple(local.shape))
    comm = _comm.current()
    me = comm.rank
    if me not in placement:
        out_shape = tuple(shape) if shape is not None else None
        if out_shape is None:
            raise ShapeError(f"from_local on rank {me}, outside {placement}: give shape=")
        return GlobalTensor(empty_local(local.dtype, local.device, local.requires_grad),
                            out_shape, placement, nd)
    coord = placement.coord_of(me)
    if shape is None or check:
        shapes = comm.all_gather(torch.tensor(list(local.shape), dtype=torch.int64),
                                 placement.flat_ranks, [(local.dim(),)] * placement.size,
                                 count_as="meta")
        shapes = [tuple(int(v) for v in s) for s in shapes]
        inferred = _infer_shape(shapes, placement, nd)
        if shape is not None and tuple(shape) != inferred:
            raise ShapeError(f"from_local: shards on {placement} with sbp {format_nd_sbp(nd)} "
                             f"make a tensor of shape {inferred}, not the given {tuple(shape)}")
        shape = inferred
        for c in placement.coords():
            want = local_shape(shape, placement.shape, nd, c)
            got = shapes[placement.flat_ranks.index(placement.rank_at(c))]
            if want != got:
                raise ShapeError(
                    f"from_local: shards do not fit together: on {placement} with sbp "
                    f"{format_nd_sbp(nd)}, a tensor of shape {shape} gives rank "
                    f"{placement.rank_at(c)} a shard of shape {want}, but it has {got} (all "
                    f"shards: {shapes})")
    shape = tuple(int(s) for s in shape)
    want = local_shape(shape, placement.shape, nd, coord)
    if tuple(local.shape) != want:
        raise ShapeError(f"from_local: rank {me}'s shard has shape {tuple(local.shape)} but a "
                         f"tensor of shape {shape} on {placement} with sbp {format_nd_sbp(nd)} "
                         f"gives it {want}")
    return GlobalTensor(local.to(_device(placement)), shape, placement, nd)


def _infer_shape(shapes: list[tuple], placement: Placement, nd: tuple) -> tuple[int, ...]:
    """Logical shape from every rank's shard shape: along a split axis, sum the sizes of the
    ranks that differ only along the dims splitting it (taken at coordinate 0 elsewhere)."""
    ndim = len(shapes[0])
    if any(len(s) != ndim for s in shapes):
        raise ShapeError(f"from_local: shards have different numbers of dims: {shapes}")
    origin = (0,) * placement.ndim
    out = []
    for a in range(ndim):
        dims = [d for d, s in enumerate(nd) if getattr(s, "axis", None) == a]
        if not dims:
            out.append(shapes[0][a])
            continue
        # nested splits: walk the dims in order, summing the parts of the first piece
        group = placement.group(dims, origin)
        seen_boxes = {}
        for r in group:
            c = placement.coord_of(r)
            key = tuple(c[d] for d in dims)
            seen_boxes[key] = shapes[placement.flat_ranks.index(r)][a]
        out.append(sum(seen_boxes.values()))
    return tuple(out)
