"""The dispatch: `apply_op` runs a registered op on global tensors. It chooses the signature
whose boxing of the inputs moves the fewest bytes (cached per layout: tensor/dispatch_records.py
keeps the entries), boxes the inputs (once for all consumers: `_boxed_for_op`), runs the kernel
on this rank's shards and wraps the outputs, telling a graph's recorder of each op.

The class reaches `apply_op` late (`global_tensor._bind_dispatch`, called by tensor/__init__.py):
this module imports the class, so the class cannot import it.
"""

from __future__ import annotations

import weakref
from typing import Sequence

import torch

from .. import comm as _comm
from ..errors import IndexOutOfRange, PlacementMismatchError, ShapeError, SignatureError
from ..ops import TensorMeta, choose, detaches, get_op, hashable
from ..placement import Placement
from ..sbp import parse_nd_sbp
from .dispatch_records import (_CHOICES, _Boxed, _Entry, _autocast_dtype, _check_dtypes,
                               _connected_empty, _describe, _intern_layout, _rank_context,
                               _same_trace)
from .global_tensor import GlobalTensor, _fresh
from .hooks import _tracing
from .mixing import _lift_args
from .views import _version

__all__ = ["apply_op", "cat"]


def apply_op(name: str, *args, sbp: Sequence | None = None, **attrs):
    """Run registered op ``name`` on global tensors (and constants) in ``args``.

    Chooses the signature whose boxing of the inputs moves the fewest bytes (cached), boxes the
    inputs, runs the kernel on the local shards, and wraps the outputs. ``sbp=`` forces the
    inputs' layouts (one nd-sbp or None per tensor input). All tensor inputs must share one
    placement: moving a tensor to another placement is an explicit ``to_global``. A plain torch
    tensor among ``args`` is taken as replicated on that placement (`lift`).
    """
    try:
        key, tensors, pl, grad, attrs_key, forced = _dispatch_key(name, args, sbp, attrs)
    except SignatureError:
        lifted = _lift_args(args)  # plain torch tensors: taken as replicated (`lift`)
        if lifted is None:
            raise
        return apply_op(name, *lifted, sbp=sbp, **attrs)
    entry = _CHOICES.get(key)
    if entry is None:
        pinned = tuple(t._local.requires_grad and t._local.is_leaf for t in tensors)
        entry = _CHOICES.put(key, _choice_entry(name, args, tensors, pl, attrs_key, forced,
                                                grad, pinned))
    if entry.mixed:
        _check_dtypes(name, tensors, pl)
    boxed = [t if t._sbp == nd else _boxed_for_op(t, nd)
             for t, nd in zip(tensors, entry.choice.ins)] if entry.moves else tensors
    comm = _rank_local.comm or _comm.current()
    comm.activity.op = name  # what a timeout report says this rank did last (memory only)
    me = comm.rank
    if me in pl._index:
        return _run_kernel(entry, args, boxed, tensors, pl, me, attrs)
    choice = entry.choice
    dtype = _autocast_dtype(name, pl)
    locals_ = tuple(_connected_empty(boxed, dtype or m.dtype) for m in choice.out_metas)
    out = _wrap_outputs(entry, locals_, pl, len(locals_) > 1)
    if _tracing.recorder is not None:  # an op of another placement: kept for the logical graph
        _tracing.recorder.op(entry, args, boxed, None, attrs, out, pl)
    return out


def _boxed_for_op(t: GlobalTensor, nd: tuple) -> GlobalTensor:
    """``t`` laid out as ``nd`` for an op: boxed once for all the consumers that need that
    layout while ``t`` is alive and unchanged (docs/internals.md, 'Boxing once for all
    consumers'); backward then runs the dual boxing once, on the summed gradient."""
    local = t._local
    boxes = t._boxes
    if boxes is not None:
        hit = boxes.get(nd)
        if hit is not None and hit.source() is local and hit.version == _version(local) and \
                hit.grad == torch.is_grad_enabled() and _same_trace(hit.trace):
            shard = hit.kept if hit.kept is not None else hit.ref()
            if shard is not None:
                return _wrap(shard, t._shape, t._placement, nd)
    out = t.to_global(sbp=nd)
    if boxes is None:
        boxes = t._boxes = {}
    parameter = local.requires_grad and local.is_leaf
    boxes[nd] = _Boxed(weakref.ref(local), _version(local), torch.is_grad_enabled(),
                       None if parameter else out._local, weakref.ref(out._local),
                       None if _tracing.recorder is None else weakref.ref(_tracing.recorder))
    return out


def _dispatch_key(name: str, args: tuple, sbp, attrs: dict) -> tuple:
    """The dispatch cache key of a call, and what building it found: (key, tensor inputs,
    their placement, whether some input needs grad, the attributes' key, forced layouts).

    Per tensor the key holds its layout id (negated for a leaf that requires grad: a parameter,
    whose layout the choice avoids moving); constants are (type, value) tuples, so a constant
    never equals a layout id (and 1 and 1.0, which give different dtypes, differ)."""
    tensors, parts = [], [name]
    grad = False
    pl = None
    for a in args:
        if isinstance(a, GlobalTensor):
            k = a._key or _layout_key(a)  # (a view keeps no key: made fresh there first)
            local = a._local
            tensors.append(a)
            if local.requires_grad:
                grad = True
                if local.is_leaf:
                    k = -k
            parts.append(k)
            if pl is None:
                pl = a._placement
            elif a._placement is not pl and a._placement != pl:
                raise PlacementMismatchError(
                    f"{name}: inputs are on different placements: {_describe(tensors[0])} and "
                    f"{_describe(a)}; move one with .to_global(placement=...) first (this is "
                    f"where a pipeline stage boundary goes)")
        else:
            parts.append((type(a), hashable(a)))
    if pl is None:
        raise SignatureError(f"{name}: needs at least one global tensor input")
    grad = grad and torch.is_grad_enabled()
    attrs_key = tuple(sorted((k, hashable(v)) for k, v in attrs.items())) if attrs else ()
    forced = None
    if sbp is not None:
        forced = tuple(None if s is None else parse_nd_sbp(s, pl.ndim) for s in sbp)
    parts += (pl, attrs_key, forced, grad)
    return tuple(parts), tensors, pl, grad, attrs_key, forced


def _run_kernel(entry: _Entry, args: tuple, boxed: list, tensors: list, pl: Placement,
                me: int, attrs: dict):
    """Run the op's kernel on this rank's shards of the (boxed) inputs; wrap the outputs."""
    choice, op = entry.choice, entry.op
    if len(boxed) == len(args):
        local_args = [t._local for t in boxed]
    else:
        it = iter(boxed)
        local_args = [next(it)._local if isinstance(a, GlobalTensor) else a for a in args]
    if op.context:
        ctx = entry.contexts.get(me) or _rank_context(entry, tensors, pl, me)
        attrs = dict(attrs)
        attrs["ctx"] = ctx
    result = op.kernel(*local_args, **attrs)
    multi = isinstance(result, (tuple, list))
    if not multi and not entry.detach:  # the common case: one output
        meta = choice.out_metas[0]
        out = _wrap(result, meta.shape, pl, choice.outs[0],
                    entry.out_keys[0] if result.dtype is meta.dtype else None)
    else:
        out = _wrap_outputs(entry, tuple(result) if multi else (result,), pl, multi)
    if _tracing.recorder is not None:
        _tracing.recorder.op(entry, args, boxed, local_args, attrs, out, pl)
    return out


def _wrap_outputs(entry: _Entry, locals_: tuple, pl: Placement, multi: bool):
    """Global tensors of the local outputs (detached where the outputs carry no gradient)."""
    choice = entry.choice
    if entry.detach:
        locals_ = tuple(t.detach() for t in locals_)
    outs = tuple(_wrap(t, m.shape, pl, nd, k if t.dtype is m.dtype else None)
                 for t, m, nd, k in zip(locals_, choice.out_metas, choice.outs, entry.out_keys))
    return outs if multi else outs[0]


_rank_local = _comm.rank_local()


def _wrap(local: torch.Tensor, shape: tuple, placement: Placement, sbp: tuple,
          key: int | None = None) -> GlobalTensor:
    """`GlobalTensor` from already-normalised metadata (the dispatch's hot path); ``key`` is
    its `_layout_key` when the caller knows it."""
    t = object.__new__(GlobalTensor)
    t._local, t._shape, t._placement, t._sbp, t._key = local, shape, placement, sbp, key
    t._boxes = t._view = None
    return t


def _layout_key(t: GlobalTensor) -> int:
    """``t``'s layout id, kept in ``t._key``. A view keeps none, so that the dispatch, which
    reads ``_key`` first, comes here on every use of one and remakes it if its base changed
    (`_fresh`): the check costs the tensors that are not views nothing."""
    if t._view is not None:
        _fresh(t)
        return t._view.key or _intern_layout(t._shape, t._local.dtype, t._sbp)
    t._key = key = _intern_layout(t._shape, t._local.dtype, t._sbp)
    return key


def _choice_entry(name, args, tensors, pl, attrs_key, forced, grad, pinned) -> tuple:
    meta_args = tuple(TensorMeta(a._shape, a.dtype) if isinstance(a, GlobalTensor)
                      else hashable(a) for a in args)
    try:
        choice = choose(name, meta_args, tuple(t._sbp for t in tensors), pl, attrs_key, forced,
                        grad, pinned)
    except (ShapeError, IndexOutOfRange) as exc:  # said with shapes only: add the layouts
        shown = "; ".join(_describe(t) for t in tensors)
        raise type(exc)(f"{exc} [inputs: {shown}]") from None
    out_keys = tuple(_intern_layout(m.shape, m.dtype, nd)
                     for m, nd in zip(choice.out_metas, choice.outs))
    moves = any(t._sbp != nd for t, nd in zip(tensors, choice.ins))
    op = get_op(name)
    mixed = op.same_dtype and len({t.dtype for t in tensors}) > 1
    return _Entry(choice, op, detaches(choice.outs), out_keys, moves, {}, mixed)


def cat(tensors: Sequence[GlobalTensor], dim: int = 0) -> GlobalTensor:
    """``torch.cat`` of global tensors on one placement (``dim`` must not be split: a split
    there is boxed first)."""
    tensors = list(tensors)
    if not tensors or not all(isinstance(t, GlobalTensor) for t in tensors):
        raise SignatureError(f"cat: needs a non-empty sequence of global tensors, got "
                             f"{[type(t).__name__ for t in tensors]}")
    return apply_op("cat", *tensors, dim=dim)
