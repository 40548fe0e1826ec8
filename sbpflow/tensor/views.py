"""Views (docs/torch_models.md, 'Views and in-place ops'): what a view of a global tensor
remembers of the tensor it views (`_View`: how it was made, and the parent's shard and version
when it last matched it), whether it is stale, and the strides torch would give it (whether a
reshape of it is a view, whether it is contiguous).

Remaking a stale view and writing an in-place op on a view through to its parent run ops:
they are `_fresh` and `_write_back` in tensor/global_tensor.py, beside the class; the view
methods (reshape, permute, indexing, ...) are in tensor/methods.py.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..caches import memoize
from ..ops.shape import Slice, decode_index

__all__ = ["is_view", "copy_view"]


class _View(NamedTuple):
    """How a view was made from ``parent``: ``kind`` "reshape" (``arg``: the shape; also
    flatten, squeeze, unsqueeze), "permute" (the dims; also transpose, t, T), "index" (an
    encoded basic index; also narrow, split, chunk), "expand" (the shape), "detach", or "copy"
    (``arg``: how to remake it and why it cannot be written: `copy_view`); and
    ``parent``'s shard object and its version when the view last matched it. When either
    differs (an in-place op on ``parent`` replaced or wrote its shard) the view is remade
    from ``parent`` before its next use (`_fresh`), as a torch view reads its base's value.
    ``key``: the view's layout id (`_layout_key`), or None."""

    parent: GlobalTensor
    kind: str
    arg: object
    local: torch.Tensor
    version: int
    key: int | None


_new_view = tuple.__new__


def is_view(t: GlobalTensor) -> bool:
    """Whether ``t`` is a view of another tensor (an in-place op on it writes through)."""
    return t._view is not None


def copy_view(out: GlobalTensor, parent: GlobalTensor, remake, why: str) -> GlobalTensor:
    """Mark ``out``, a copy standing for what torch returns as a view of ``parent``: it is
    remade by ``remake(parent)`` when ``parent`` changes (a view reads its base's value), and an
    in-place op on it raises `UnsupportedTorchFunction` saying ``why`` (it would not reach
    ``parent``)."""
    return _viewed(out, parent, "copy", (remake, why))


def _viewed(out: GlobalTensor, parent: GlobalTensor, kind: str, arg) -> GlobalTensor:
    """Mark ``out`` a view of ``parent`` (`_View`)."""
    local = parent._local
    try:
        version = local._version
    except RuntimeError:  # an inference tensor (see `_version`)
        version = -1
    # _View(...), faster; the layout id moves into it (`_layout_key`)
    out._view = _new_view(_View, (parent, kind, arg, local, version, out._key))
    out._key = None
    return out


def _version(local: torch.Tensor) -> int:
    try:
        return local._version
    except RuntimeError:  # an inference tensor tracks none: in-place ops replace its shard
        return -1


def _stale(t: GlobalTensor) -> bool:
    parent, _, _, held, version, _ = t._view
    local = parent._local
    return local is not held or _version(local) != version or \
        (parent._view is not None and _stale(parent))


def _take(t: GlobalTensor, new: GlobalTensor) -> None:
    """``t`` holds ``new``'s shard, in ``new``'s layout (no copy)."""
    t._local, t._placement, t._sbp, t._boxes = new._local, new._placement, new._sbp, None
    t._key = None if t._view is not None else new._key


def _chain(t: GlobalTensor) -> tuple:
    """(the shape of the tensor ``t`` views at the end of its chain, the steps from it)."""
    steps = []
    while t._view is not None:
        steps.append((t._view.kind, t._view.arg))
        t = t._view.parent
    return t._shape, tuple(reversed(steps))


_META_STEP = {"reshape": lambda m, a: m.reshape(a), "permute": lambda m, a: m.permute(a),
              "index": lambda m, a: m[decode_index(a)], "expand": lambda m, a: m.expand(a),
              "detach": lambda m, a: m}


@memoize(4096)
def _meta_of(root: tuple, steps: tuple) -> torch.Tensor:
    """A meta tensor with the strides torch would give a view made by ``steps`` from a
    contiguous tensor of shape ``root``."""
    m = torch.empty(root, device="meta")
    for kind, arg in steps:
        m = _META_STEP[kind](m, arg)
    return m


def _strided(t: GlobalTensor) -> torch.Tensor:
    """The strides torch would give ``t`` (a meta tensor): a tensor that is not a view is
    taken as contiguous."""
    return _meta_of(*_chain(t))


@memoize(4096)
def _reshape_views(root: tuple, steps: tuple, shape: tuple) -> bool:
    return _meta_of(root, steps).reshape(shape)._is_view()


def _reshaped(t: GlobalTensor, out: GlobalTensor) -> GlobalTensor:
    """``out``, a reshape of ``t``, marked a view of ``t`` where torch's reshape gives a view:
    always when ``t`` is not a view, else when its strides allow it (else torch copies)."""
    if t._view is not None and not _reshape_views(*_chain(t), out._shape):
        return out
    return _viewed(out, t, "reshape", out._shape)


_WHOLE = Slice(None, None, None)


@memoize(1024)
def _swapped(ndim: int, dim0: int, dim1: int) -> tuple:
    """The permutation of ``ndim`` axes that ``transpose(dim0, dim1)`` is."""
    dims = list(range(ndim))
    if dims:
        a, b = dim0 % ndim, dim1 % ndim
        dims[a], dims[b] = dims[b], dims[a]
    return tuple(dims)


def _axis_slice(d: int, start: int, stop: int) -> tuple:
    return (_WHOLE,) * d + (Slice(start, stop, None),)


def _pieces(t: GlobalTensor, outs: tuple, dim: int) -> tuple:
    """``split`` / ``chunk`` pieces of ``t`` along ``dim``, each marked a view of ``t``."""
    d = dim % max(t.ndim, 1)
    start = 0
    for o in outs:
        n = o._shape[d] if o.ndim else 1
        _viewed(o, t, "index", _axis_slice(d, start, start + n))
        start += n
    return outs
