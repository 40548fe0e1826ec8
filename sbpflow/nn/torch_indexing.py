"""Advanced indexing of global tensors, and torch tensors written with global values.

``x[index]`` with tensors, lists or bools in the index runs torch's indexing on the whole
values by the fallback (`torch_fallback`: replicated, or eager for a bool mask, whose result's
size depends on its values), except where a split ``x`` has its rows picked in order
(``mask[batch_idx, kv_idx]``, as transformers builds its attention masks): each rank indexes
its own rows. A basic index stays a view (`GlobalTensor.__getitem__`). A plain torch tensor
written with global tensors (``buf[:, :n] = ids``, ``buf.copy_(x)``: buffers transformers makes
with ``torch.full(..., device=ids.device)``) is the same on every rank, so it takes their whole
values and stays a torch tensor. See docs/torch_models.md, 'What runs'.
"""

from __future__ import annotations

import warnings

import torch

from .. import comm as _comm
from ..comm.base import counted_as
from ..ops.shape import Slice, encode_index
from ..errors import SbpError
from ..sbp import B, Split, shard_box
from ..tensor import GlobalTensor, UnsupportedTorchFunction, recording
from .torch_fallback import ReplicatedFallbackWarning, fallback_for

__all__ = ["getitem", "writes_plain", "write_plain"]

# torch's in-place operators: they write into their first argument as ``name_`` methods do
_IN_PLACE_OPERATORS = frozenset({
    "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__idiv__",
    "__ifloordiv__", "__imod__", "__ipow__", "__imatmul__", "__iand__", "__ior__", "__ixor__",
    "__ilshift__", "__irshift__"})
_WARNED: set = set()


def _index_with(x: torch.Tensor, index: tuple) -> torch.Tensor:
    """``x[index]``, the index's `Slice` items as slices (a module function: the fallback
    caches its routes by function and by the index's constants, which must hash)."""
    return x[tuple(it.to_slice() if type(it) is Slice else it for it in index)]


_ADVANCED = fallback_for(_index_with, "Tensor.__getitem__")


def getitem(x: GlobalTensor, index) -> GlobalTensor:
    """``x[index]`` as torch's: a basic index is `GlobalTensor.__getitem__` (a view); rows of a
    split ``x`` picked in order (`_own_rows`) stay split; another index with tensors, lists or
    bools runs on the whole values (inputs gathered to ``B``, the result ``B``; counted as
    "fallback" and warned once by `torch_fallback`)."""
    items = index if isinstance(index, tuple) else (index,)
    try:
        encode_index(items)
    except SbpError:
        own = _own_rows(x, items)
        if own is not None:
            return own
        return _ADVANCED(x, tuple(Slice(it.start, it.stop, it.step) if type(it) is slice
                                  else it for it in items))
    return x[index]


def _own_rows(x: GlobalTensor, items: tuple) -> GlobalTensor | None:
    """``x[i0, i1, ...]`` with replicated integer index tensors where ``x`` is split on axis
    ``a`` of a 1-D placement and ``i_a`` is ``arange(n)`` along one axis ``k`` of the indices'
    broadcast shape (transformers' ``padding_mask[batch_idx, kv_idx]``): each rank indexes its
    own rows, the result split on ``k``, nothing gathered (the indices' values are on every
    rank). None for any other call (and for a tensor in the autograd graph or a graph build)."""
    pl = x.placement
    if pl.ndim != 1 or pl.size != _comm.world_size() or not isinstance(x.sbp[0], Split) or \
            x.requires_grad or recording():
        return None
    a = x.sbp[0].axis
    if a >= len(items) or not all(
            isinstance(t, GlobalTensor) and t.sbp == (B,) and not t.dtype.is_floating_point
            and t.dtype != torch.bool for t in items):
        return None
    idx = [t.local for t in items]
    shape = torch.broadcast_shapes(*(i.shape for i in idx))
    rows, n = idx[a], x.shape[a]
    if [d for d in rows.shape if d != 1] != [n] or not torch.equal(
            rows.reshape(-1), torch.arange(n, device=rows.device)):
        return None
    k = len(shape) - rows.ndim + next(i for i, d in enumerate(rows.shape) if d != 1)
    start, size = shard_box(x.shape, pl.shape, x.sbp, pl.coord_of(_comm.rank()))[a]

    def local(t: torch.Tensor) -> torch.Tensor:   # axis k of the broadcast: this rank's rows
        at = k - (len(shape) - t.ndim)
        return t if at < 0 or t.shape[at] == 1 else t.narrow(at, start, size)
    picks = [local(t) for t in idx]
    picks[a] = picks[a] - start
    return GlobalTensor(x.local[tuple(picks)], tuple(shape) + tuple(x.shape[len(items):]), pl,
                        (Split(k),))


def writes_plain(func, args: tuple) -> bool:
    """``func`` writes into its first argument (an in-place method or operator) and that is a
    plain torch tensor."""
    if not args or not isinstance(args[0], torch.Tensor):
        return False
    name = getattr(func, "__name__", "") or ""
    return name in _IN_PLACE_OPERATORS or (name.endswith("_") and not name.startswith("_"))


def _whole(value):
    if isinstance(value, GlobalTensor):
        return value.full_tensor()
    if type(value) in (tuple, list):
        return type(value)(_whole(v) for v in value)
    return value


def write_plain(func, args: tuple, kwargs: dict):
    """torch's ``func`` writing into the plain torch tensor ``args[0]``, each global tensor among
    its arguments replaced by its whole value (gathered: collective, counted as "fallback",
    warned once): the torch tensor, the same on every rank, stays one."""
    name = getattr(func, "__name__", repr(func))
    if recording():
        raise UnsupportedTorchFunction(
            f"Tensor.{name} writes global tensors into a plain torch tensor, which a graph on "
            f"global tensors cannot hold; make the target a global tensor (sf.zeros, sf.full, "
            f"sf.tensor) or call it outside the graph's build")
    if name not in _WARNED:
        _WARNED.add(name)
        warnings.warn(
            f"Tensor.{name} writes global tensors into a plain torch tensor of shape "
            f"{tuple(args[0].shape)}: they are gathered whole on every rank (counted as "
            f"'fallback' in sf.comm.stats()). Correct; make the target a global tensor to keep "
            f"their layout", ReplicatedFallbackWarning, stacklevel=4)
    with counted_as("fallback"):
        args, kwargs = _whole(args), {k: _whole(v) for k, v in kwargs.items()}
    return func(*args, **kwargs)
