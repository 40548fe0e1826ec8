"""Shape ops: reshape, transpose, permute, flatten, unsqueeze, squeeze, narrow, expand, getitem
(basic indexing), setitem (``x[index] = value`` as a new tensor), index_select, cat, split,
chunk. None of them computes anything: they move elements, so a split axis can often be
followed through, and partial sums pass through unchanged.

``getitem`` takes basic indices; one list of ints (``x[:, [-1]]``) is basic indexing then
``index_select`` (`list_index`); other advanced indices raise `AdvancedIndexError`. An index
out of range raises `IndexOutOfRange` on every rank. ``reshape`` and ``expand`` are context kernels (their
attribute is a logical shape). See docs/internals.md, 'Shape-op signatures' (the split-axis
rules and why they are safe).
"""

from __future__ import annotations

import itertools
import math
import operator
from functools import lru_cache
from typing import NamedTuple

import torch

from ..caches import memoize
from ..errors import AdvancedIndexError, IndexOutOfRange
from ..sbp import shard_box
from .registry import Signature, TensorMeta, register, register_attr_type, tensor_metas

__all__ = ["AdvancedIndexError", "Slice", "encode_index", "decode_index", "list_index",
           "view_signatures",
           "local_view_shape", "resolve_shape", "PARTIALS"]

PARTIALS = ("P",)


# -- helpers ---------------------------------------------------------------------------------------
def _meta(shape, dtype=torch.float32) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype, device="meta")


def _norm(d: int, ndim: int) -> int:
    n = max(ndim, 1)
    if not -n <= d < n:
        raise IndexError(f"dim {d} is out of range for a tensor with {ndim} dimension(s)")
    return d % n


def _passthrough(n_in: int = 1, n_out: int = 1) -> list[Signature]:
    """Partial sums through (the ops are linear), then all-B."""
    sigs = [Signature([p] * n_in, [p] * n_out) for p in PARTIALS]
    sigs.append(Signature(["B"] * n_in, ["B"] * n_out))
    return sigs


def _box_shape(box) -> tuple:
    return tuple(n for _, n in box)


def view_signatures(xs: tuple, ys: tuple) -> list[Signature]:
    """A reshape of ``xs`` into ``ys`` (docs/internals.md, 'Shape-op signatures'): first
    ``S(a) -> S(b)`` where the prefix products agree (each rank's part is then one contiguous
    block of the row-major order in both), then ``S(a) -> S(b)`` for every other pair of axes
    that overlap in the row-major order (the prefix-product spans ``[prod(xs[:a]),
    prod(xs[:a+1]))`` and ``[prod(ys[:b]), prod(ys[:b+1]))`` intersect: where a nested split can
    land), then pass-through. Only the first kind is valid on its own; a combination over mesh
    dims is valid iff every rank's input and output shards hold the same elements, which the
    context kernels check exactly (`same_shards`)."""
    sigs, nested = [], []
    if math.prod(xs) > 0:
        for a in range(len(xs)):
            if xs[a] == 1:
                continue
            lo = math.prod(xs[:a])
            for b in range(len(ys)):
                if ys[b] == 1:
                    continue
                lo_b = math.prod(ys[:b])
                if lo_b == lo:
                    sigs.append(Signature([f"S({a})"], [f"S({b})"]))
                elif max(lo, lo_b) < min(lo * xs[a], lo_b * ys[b]):
                    nested.append(Signature([f"S({a})"], [f"S({b})"]))
    return sigs + nested + _passthrough()


def flat_runs(shape: tuple, box: tuple) -> tuple | None:
    """A canonical form of the set of row-major flat indices that ``box`` (a `shard_box` of a
    tensor of ``shape``) covers: equal forms iff equal sets (None: the empty set). Axes of size
    1 are dropped, then an axis merges into the one before it when it is taken whole or the one
    before holds a single index; what is left is a tuple of ``(size, start, length)``."""
    runs: list = []
    for n, (start, length) in zip(shape, box):
        if length == 0:
            return None
        if n == 1:
            continue
        runs.append((n, start, length))
        while len(runs) > 1:
            (n1, s1, l1), (n2, s2, l2) = runs[-2], runs[-1]
            if s2 == 0 and l2 == n2:        # inner taken whole: a block of whole rows
                runs[-2:] = [(n1 * n2, s1 * n2, l1 * n2)]
            elif l1 == 1:                   # one outer index: a run inside one row
                runs[-2:] = [(n1 * n2, s1 * n2 + s2, l2)]
            else:
                break
    return tuple(runs)


@memoize(4096)
def same_shards(xs: tuple, ys: tuple, mesh_shape: tuple, in_nd: tuple, out_nd: tuple) -> bool:
    """Whether a reshape of ``xs`` laid out ``in_nd`` into ``ys`` laid out ``out_nd`` is local:
    on every rank of the mesh the input shard and the output shard cover the same row-major
    flat indices (both list them in increasing order, so the local reshape is then exact)."""
    for coord in itertools.product(*(range(m) for m in mesh_shape)):
        if flat_runs(xs, shard_box(xs, mesh_shape, in_nd, coord)) != \
                flat_runs(ys, shard_box(ys, mesh_shape, out_nd, coord)):
            return False
    return True


def _local_view(x: torch.Tensor, ys, ctx) -> torch.Tensor:
    """The local shard of a reshape to the logical shape ``ys()`` under the rank's context.
    On meta tensors (the registry validating a candidate) a RuntimeError, which rejects it,
    unless the layouts keep every rank's elements (`same_shards`: a local shape that fits is
    not enough); real calls run only signatures validated so, and skip the check."""
    if x.is_meta:
        xs, out = tuple(ctx.in_shapes[0]), tuple(ys())
        mesh = tuple(ctx.placement.shape)
        if not same_shards(xs, out, mesh, ctx.ins[0], ctx.outs[0]):
            raise RuntimeError(f"reshape {xs} -> {out} from {ctx.ins[0]} to {ctx.outs[0]} on a "
                               f"mesh of shape {mesh} moves elements between ranks")
    return x.reshape(_box_shape(ctx.out_boxes[0]))


def resolve_shape(numel: int, shape) -> tuple:
    """``shape`` with a single ``-1`` resolved for ``numel`` elements (unchanged when it cannot
    be: the op then reports the error)."""
    try:
        return _resolved(numel, shape)
    except TypeError:  # unhashable (a list): as a tuple
        return _resolved(numel, tuple(shape))


@memoize(4096)
def _resolved(numel: int, shape) -> tuple:
    shape = tuple(int(s) for s in shape)
    if shape.count(-1) != 1:
        return shape
    rest = math.prod(s for s in shape if s != -1)
    if rest <= 0 or numel % rest:
        return shape
    return tuple(numel // rest if s == -1 else s for s in shape)


def local_view_shape(local: tuple, shape: tuple) -> tuple:
    """The shape a reshape to the LOGICAL ``shape`` gives a shard of shape ``local``, when only
    the local shape is known (``ctx=None``): the plain reshape if it fits, else the split of
    ``local`` and ``shape`` into groups of equal element counts in which only a group's leading
    output axis shrinks (preferring the most groups, then the fewest shrunk). Ambiguous cases
    may give a shape the registry's check then rejects; never a wrong value."""
    local, shape = tuple(local), tuple(shape)
    try:
        return tuple(_meta(local).reshape(shape).shape)
    except RuntimeError:
        pass
    n, m = len(local), len(shape)

    def group(px: int, ys: tuple):
        if -1 in ys:
            others = math.prod(y for y in ys if y != -1)
            if others <= 0 or px % others:
                return None
            return tuple(px // others if y == -1 else y for y in ys), 0
        if px == math.prod(ys):
            return ys, 0
        rest = math.prod(ys[1:])
        if rest > 0 and px % rest == 0 and px // rest < ys[0]:
            return (px // rest,) + ys[1:], 1
        return None

    @lru_cache(maxsize=None)
    def best(i: int, p: int):
        if i == n and p == m:
            return (0, 0), ()
        found = None
        for i2 in range(i + 1, n + 1):
            px = math.prod(local[i:i2])
            for p2 in range(p + 1, m + 1):
                g = group(px, shape[p:p2])
                if g is None:
                    continue
                rest = best(i2, p2)
                if rest is None:
                    continue
                key = (rest[0][0] - 1, rest[0][1] + g[1])
                if found is None or key < found[0]:
                    found = (key, g[0] + rest[1])
        return found

    if n == 0 or m == 0:
        raise RuntimeError(f"shape {shape} is invalid for a shard of shape {local}")
    res = best(0, 0)
    if res is None:
        raise RuntimeError(f"shape {shape} is invalid for a shard of shape {local}")
    return res[1]


# -- reshape / flatten / unsqueeze / squeeze -------------------------------------------------------
def _reshape(x, shape, ctx=None):
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if ctx is not None:
        return _local_view(x, lambda: resolve_shape(math.prod(ctx.in_shapes[0]), shape), ctx)
    return x.reshape(local_view_shape(tuple(x.shape), shape))


def _reshape_signatures(x: TensorMeta, shape) -> list[Signature]:
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    return view_signatures(x.shape, tuple(_meta(x.shape).reshape(shape).shape))


def _flatten(x, start_dim=0, end_dim=-1, ctx=None):
    if ctx is not None:  # a context kernel: nested splits may land on the merged axis
        return _local_view(x, lambda: _flattened(tuple(ctx.in_shapes[0]), start_dim, end_dim),
                           ctx)
    return torch.flatten(x, start_dim, end_dim)


@memoize(1024)
def _flattened(shape: tuple, start_dim: int, end_dim: int) -> tuple:
    return tuple(torch.flatten(_meta(shape), start_dim, end_dim).shape)


def _flatten_signatures(x: TensorMeta, start_dim=0, end_dim=-1) -> list[Signature]:
    return view_signatures(x.shape, _flattened(tuple(x.shape), start_dim, end_dim))


def _unsqueeze(x, dim):
    return torch.unsqueeze(x, dim)


def _unsqueeze_signatures(x: TensorMeta, dim) -> list[Signature]:
    return view_signatures(x.shape, tuple(torch.unsqueeze(_meta(x.shape), dim).shape))


def _squeeze(x, dim=None):
    if dim is None:
        return torch.squeeze(x)
    return torch.squeeze(x, tuple(dim) if isinstance(dim, (list, tuple)) else dim)


def _squeeze_signatures(x: TensorMeta, dim=None) -> list[Signature]:
    return view_signatures(x.shape, tuple(_squeeze(_meta(x.shape), dim).shape))


def squeeze_dims(shape: tuple, dim=None):
    """The axes a squeeze removes: those of ``dim`` (all if None) of logical size 1 (``dim``
    unchanged if it is out of range: the op reports it)."""
    ndim = len(shape)
    dims = tuple(range(ndim)) if dim is None else (dim,) if isinstance(dim, int) else tuple(dim)
    if any(not -max(ndim, 1) <= d < max(ndim, 1) for d in dims):
        return dim
    return tuple(sorted({d % ndim for d in dims if ndim and shape[d % ndim] == 1}))


# -- transpose / permute ---------------------------------------------------------------------------
def _permutation_signatures(perm: list[int]) -> list[Signature]:
    return [Signature([f"S({a})"], [f"S({perm.index(a)})"]) for a in range(len(perm))] \
        + _passthrough()


def _transpose_signatures(x: TensorMeta, dim0, dim1) -> list[Signature]:
    perm = list(range(x.ndim))
    if x.ndim:
        d0, d1 = _norm(dim0, x.ndim), _norm(dim1, x.ndim)
        perm[d0], perm[d1] = perm[d1], perm[d0]
    return _permutation_signatures(perm)


def _permute_signatures(x: TensorMeta, dims) -> list[Signature]:
    return _permutation_signatures([_norm(d, x.ndim) for d in dims])


# -- expand ----------------------------------------------------------------------------------------
def _expand(x, shape, ctx=None):
    if ctx is not None:
        return x.expand(_box_shape(ctx.out_boxes[0]))
    # Only local shapes are known: an axis whose size is not 1 is kept as it is (a split shard
    # of a non-broadcast axis); a size-1 axis is broadcast (a split shard that happens to hold
    # one element is then mis-sized, and the registry's check rejects that candidate).
    shape = tuple(shape)
    k = len(shape) - x.ndim
    target = [s if i < k or x.shape[i - k] == 1 else -1 for i, s in enumerate(shape)]
    return x.expand(target)


def _expand_signatures(x: TensorMeta, shape) -> list[Signature]:
    ys = tuple(_meta(x.shape).expand(tuple(shape)).shape)
    k = len(ys) - x.ndim
    sigs = [Signature([f"S({a})"], [f"S({a + k})"]) for a in range(x.ndim)
            if x.shape[a] == ys[a + k] and x.shape[a] > 1]
    return sigs + _passthrough()


# -- narrow ----------------------------------------------------------------------------------------
def _narrow(x, dim, start, length):
    if x.is_meta and not -x.shape[dim] <= start <= x.shape[dim]:
        # the registry reads the output shape first and would turn torch's IndexError into a
        # ShapeError: the signature generator, which runs next, raises IndexOutOfRange instead
        start = 0
    return torch.narrow(x, dim, start, length)


def _narrow_signatures(x: TensorMeta, dim, start, length) -> list[Signature]:
    d = _norm(dim, x.ndim)
    n = x.shape[d]
    if not -n <= start <= n:  # torch's IndexError (the meta kernel clamped it: see _narrow)
        raise IndexOutOfRange(f"narrow: start {start} is out of range [-{n}, {n}] for axis {d} "
                              f"of size {n} (tensor of shape {x.shape})")
    return [Signature([f"S({a})"], [f"S({a})"]) for a in range(x.ndim) if a != d] \
        + _passthrough()


# -- getitem (basic indexing) ----------------------------------------------------------------------
@register_attr_type
class Slice(NamedTuple):
    """A hashable stand-in for a ``slice`` in an encoded index (a named tuple: hashing and
    comparing it, as the dispatch cache does on every call, runs in C)."""

    start: int | None
    stop: int | None
    step: int | None

    def to_slice(self) -> slice:
        return slice(self.start, self.stop, self.step)


_WHOLE = Slice(None, None, None)


def _as_int(v, what: str, describe: str):
    if v is None:
        return None
    if isinstance(v, bool) or not hasattr(v, "__index__"):
        raise AdvancedIndexError(f"{describe}: {what} must be an int or None, got {v!r}")
    try:
        return operator.index(v)
    except TypeError:  # e.g. a tensor with more than one element
        raise AdvancedIndexError(f"{describe}: {what} must be an int or None, got {v!r}") from None


def encode_index(index, describe: str = "getitem") -> tuple:
    """``index`` as a hashable tuple of int / None / Ellipsis / `Slice`; `AdvancedIndexError`
    (naming ``describe``: the tensor's shape, placement and sbp) for anything else."""
    items = index if isinstance(index, tuple) else (index,)
    out = []
    for it in items:
        if it is None or it is Ellipsis or type(it) is int:
            out.append(it)
        elif type(it) is slice and it.start is None and it.stop is None and it.step is None:
            out.append(_WHOLE)
        elif isinstance(it, Slice):
            out.append(it)
        elif isinstance(it, slice):
            out.append(Slice(_as_int(it.start, "a slice start", describe),
                             _as_int(it.stop, "a slice stop", describe),
                             _as_int(it.step, "a slice step", describe)))
        elif isinstance(it, int) and not isinstance(it, bool):
            out.append(int(it))
        elif type(it).__module__ == "numpy" and hasattr(it, "__index__") and \
                getattr(it, "ndim", 0) == 0 and not isinstance(it, bool) and \
                "bool" not in type(it).__name__:
            out.append(operator.index(it))
        else:
            kind = type(it).__name__
            raise AdvancedIndexError(
                f"{describe}: index {index!r} holds a {kind}: global tensors support basic "
                f"indexing only (int, slice, None, ...); advanced indexing with tensors, lists "
                f"or bools is not supported (use gather / masked ops instead)")
    return tuple(out)


def decode_index(index) -> tuple:
    """A torch basic index from an encoded (or plain) one."""
    try:
        return _decoded(index)
    except TypeError:  # unhashable: a plain index (with slices)
        pass
    items = index if isinstance(index, tuple) else (index,)
    return _decoded(encode_index(items))


@memoize(4096)
def _decoded(index) -> tuple:
    items = index if isinstance(index, tuple) else (index,)
    if not all(it is None or it is Ellipsis or type(it) is Slice or type(it) is int
               for it in items):
        items = encode_index(items)   # a plain index: validate it
    return tuple(it.to_slice() if type(it) is Slice else it for it in items)


def _index_plan(index, shape: tuple) -> dict:
    """For each input axis taken whole by ``index``, the output axis it becomes."""
    items = encode_index(index)
    ndim = len(shape)
    consumed = sum(1 for it in items if it is not None and it is not Ellipsis)
    if consumed > ndim:
        raise IndexError(f"too many indices ({consumed}) for a tensor of shape {shape}")
    if sum(it is Ellipsis for it in items) > 1:
        raise IndexError("an index can only have a single ellipsis")
    full = []
    for it in items:
        full.extend([Slice(None, None, None)] * (ndim - consumed) if it is Ellipsis else [it])
    if Ellipsis not in items:
        full.extend([Slice(None, None, None)] * (ndim - consumed))
    plan, a, b = {}, 0, 0
    for it in full:
        if it is None:
            b += 1
        elif isinstance(it, int):
            if not -shape[a] <= it < shape[a]:
                raise IndexOutOfRange(f"getitem: index {it} is out of range for axis {a} of "
                                      f"size {shape[a]} (tensor of shape {shape}; index "
                                      f"{decode_index(index)})")
            a += 1
        else:
            n = shape[a]
            start = 0 if it.start is None else it.start + (n if it.start < 0 else 0)
            stop = n if it.stop is None else it.stop + (n if it.stop < 0 else 0)
            if it.step in (None, 1) and start <= 0 and stop >= n:
                plan[a] = b
            a += 1
            b += 1
    return plan


def _getitem(x, index):
    idx = decode_index(index)
    if not x.is_meta:
        return x[idx]
    try:
        return x[idx]
    except IndexError:
        # an int outside its axis: the registry reads the output shape first and would turn
        # torch's IndexError into a ShapeError. Any in-range int gives the same shape; the
        # signature generator, which runs next (`_index_plan`), raises IndexOutOfRange.
        return x[tuple(0 if type(it) is int else it for it in idx)]


def _getitem_signatures(x: TensorMeta, index) -> list[Signature]:
    plan = _index_plan(index, x.shape)
    return [Signature([f"S({a})"], [f"S({b})"]) for a, b in plan.items() if x.shape[a] > 1] \
        + _passthrough()


# -- setitem (basic indexing, written) --------------------------------------------------------------
def _setitem(x, value, index):
    """``x`` with ``x[index] = value`` (a new tensor: the caller's in-place op takes it)."""
    idx = decode_index(index)
    out = x.clone()
    if x.is_meta:  # an int outside its axis: as `_getitem`, the signatures raise instead
        try:
            out[idx] = value
        except IndexError:
            out[tuple(0 if type(it) is int else it for it in idx)] = value
        return out
    out[idx] = value
    return out


def _setitem_signatures(x: TensorMeta, value: TensorMeta, index) -> list[Signature]:
    """An axis of ``x`` the index takes whole may stay split: ``value`` is then split on the
    matching axis of the region (``B`` where it broadcasts along it). Partial sums pass (the
    region of a sum of parts is the sum of their regions)."""
    plan = _index_plan(index, x.shape)
    region = tuple(_getitem(_meta(x.shape), index).shape)
    k = len(region) - value.ndim
    sigs = []
    for a, b in plan.items():
        if x.shape[a] <= 1:
            continue
        vb = b - k
        held = vb >= 0 and value.shape[vb] == region[b]
        sigs.append(Signature([f"S({a})", f"S({vb})" if held else "B"], [f"S({a})"]))
    return sigs + _passthrough(2, 1)


# -- list indices: basic indexing, then index_select ---------------------------------------------
def _is_pick_list(it) -> bool:
    """A list / tuple of ints or a 1-D integer torch tensor (torch's advanced index)."""
    if isinstance(it, torch.Tensor):
        return it.ndim == 1 and not it.dtype.is_floating_point and it.dtype != torch.bool
    return isinstance(it, list) and all(type(v) is int for v in it)


def list_index(index, shape: tuple) -> tuple | None:
    """An index holding one list of ints (``x[:, [-1], :]``) as ``(basic, dim, picks)``: the
    basic index with the list taken whole, the output axis the list applies to and its
    entries made non-negative; then ``index_select(dim, picks)`` gives torch's result. None
    when the index is not of that form (bools, several lists: not supported)."""
    items = index if isinstance(index, tuple) else (index,)
    lists = [i for i, it in enumerate(items) if _is_pick_list(it)]
    if len(lists) != 1:
        return None
    at = lists[0]
    picks = items[at].tolist() if isinstance(items[at], torch.Tensor) else list(items[at])
    basic = items[:at] + (slice(None),) + items[at + 1:]
    encoded = encode_index(basic)  # raises for anything that is not basic
    consumed = sum(1 for it in encoded if it is not None and it is not Ellipsis)
    out_dim, in_dim = 0, 0
    for it in encoded[:at]:
        if it is Ellipsis:
            out_dim += len(shape) - consumed
            in_dim += len(shape) - consumed
        elif it is None:
            out_dim += 1
        else:
            out_dim += 0 if type(it) is int else 1
            in_dim += 1
    if in_dim >= len(shape):
        raise IndexError(f"too many indices for a tensor of shape {shape}")
    n = shape[in_dim]
    bad = [p for p in picks if not -n <= p < n]
    if bad:
        raise IndexOutOfRange(f"getitem: index {bad[0]} is out of range for axis {in_dim} of "
                              f"size {n} (tensor of shape {shape})")
    return encoded, out_dim, tuple(p % n for p in picks)


def _index_select(x, dim, index):
    return torch.index_select(x, dim, torch.tensor(index, dtype=torch.long, device=x.device))


def _index_select_signatures(x: TensorMeta, dim, index) -> list[Signature]:
    d = _norm(dim, x.ndim)
    return [Signature([f"S({a})"], [f"S({a})"]) for a in range(x.ndim) if a != d] \
        + _passthrough()


# -- cat / split / chunk ---------------------------------------------------------------------------
def _cat(*xs, dim=0):
    return torch.cat(xs, dim)


def _cat_signatures(*args, dim=0) -> list[Signature]:
    metas = tensor_metas(args)
    ndim = metas[0].ndim
    d = _norm(dim, ndim)
    n = len(metas)
    return [Signature([f"S({a})"] * n, [f"S({a})"]) for a in range(ndim) if a != d] \
        + _passthrough(n, 1)


def _split(x, split_size, dim=0):
    return tuple(torch.split(x, split_size, dim))


def _chunk(x, chunks, dim=0):
    return tuple(torch.chunk(x, chunks, dim))


def _pieces(x: TensorMeta, dim: int, k: int) -> list[Signature]:
    d = _norm(dim, x.ndim)
    return [Signature([f"S({a})"], [f"S({a})"] * k) for a in range(x.ndim) if a != d] \
        + _passthrough(1, k)


def _split_signatures(x: TensorMeta, split_size, dim=0) -> list[Signature]:
    return _pieces(x, dim, len(_split(_meta(x.shape), split_size, dim)))


def _chunk_signatures(x: TensorMeta, chunks, dim=0) -> list[Signature]:
    return _pieces(x, dim, len(_chunk(_meta(x.shape), chunks, dim)))


# -- registrations ---------------------------------------------------------------------------------
register("reshape", _reshape, _reshape_signatures, context=True,
         doc="reshape to a logical shape (may hold -1); splits follow contiguous blocks")
register("transpose", lambda x, dim0, dim1: torch.transpose(x, dim0, dim1), _transpose_signatures,
         doc="swap two axes; splits follow")
register("permute", lambda x, dims: x.permute(tuple(dims)), _permute_signatures,
         doc="reorder axes; splits follow")
register("flatten", _flatten, _flatten_signatures, context=True,
         doc="merge axes start_dim..end_dim; a split of start_dim stays on the merged axis")
register("unsqueeze", _unsqueeze, _unsqueeze_signatures, doc="insert a size-1 axis")
register("squeeze", _squeeze, _squeeze_signatures, doc="remove size-1 axes (dim: int, tuple, None)")
register("expand", _expand, _expand_signatures, context=True,
         doc="broadcast size-1 axes to a logical shape (-1 keeps an axis)")
register("narrow", _narrow, _narrow_signatures, doc="a range of one axis (not split)")
register("getitem", _getitem, _getitem_signatures,
         doc="basic indexing; indexed axes are not split, axes taken whole keep their split")
register("setitem", _setitem, _setitem_signatures,
         doc="x with x[index] = value (basic index); axes taken whole keep their split")
register("index_select", _index_select, _index_select_signatures,
         doc="the entries index (a tuple of non-negative ints) of axis dim (not split)")
register("cat", _cat, _cat_signatures, doc="concatenate along dim (not split)")
register("split", _split, _split_signatures,
         doc="pieces of split_size (int or list) along dim (not split); a tuple")
register("chunk", _chunk, _chunk_signatures,
         doc="chunks pieces along dim (not split); a tuple")
