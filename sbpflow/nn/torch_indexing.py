"""Advanced indexing of global tensors, and torch tensors written with global values.

``x[index]`` with tensors, lists or bools in the index (``mask[batch_idx, kv_idx]``, as
transformers builds its attention masks) runs torch's indexing on the whole values by the
fallback (`torch_fallback`: replicated, or eager for a bool mask, whose result's size depends
on its values); a basic index stays a view (`GlobalTensor.__getitem__`). A plain torch tensor
written with global tensors (``buf[:, :n] = ids``, ``buf.copy_(x)``: buffers transformers makes
with ``torch.full(..., device=ids.device)``) is the same on every rank, so it takes their whole
values and stays a torch tensor. See docs/torch_models.md, 'What runs'.
"""

from __future__ import annotations

import warnings

import torch

from ..comm.base import counted_as
from ..ops.shape import Slice, encode_index
from ..errors import SbpError
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
    """``x[index]`` as torch's: a basic index is `GlobalTensor.__getitem__` (a view); one with
    tensors, lists or bools runs on the whole values (inputs gathered to ``B``, the result
    ``B``; counted as "fallback" and warned once by `torch_fallback`)."""
    items = index if isinstance(index, tuple) else (index,)
    try:
        encode_index(items)
    except SbpError:
        return _ADVANCED(x, tuple(Slice(it.start, it.stop, it.step) if type(it) is slice
                                  else it for it in items))
    return x[index]


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
