"""Splitting a graph's inputs into micro-batches along their batch axis (axis 0).

Each rank cuts its own shard in k balanced pieces (no communication): micro-batch m is, on
every rank, piece m of its rows, so the union of the micro-batches is the batch. When the batch
axis is not split over the mesh this is the global slice; when it is, a micro-batch gathers
piece m of every rank's rows (a permutation of the global slice, which a per-sample loss does
not see). The pieces must again form a valid layout of the micro-batch (each rank's piece the
size the layout gives it); batch sizes that do not allow it raise `GraphError` naming a size
that does. See docs/runtime.md, 'Graph mode'.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import torch

from ..caches import memoize
from ..errors import GraphError
from ..sbp import Split, format_nd_sbp, local_shape
from ..tensor import GlobalTensor
from ..utils import sequence_of

__all__ = ["MicroBatches", "split_inputs", "signature", "flatten_inputs", "unflatten_inputs"]


class MicroBatches(NamedTuple):
    """``args[m]``: the build arguments of micro-batch m; ``sizes[m]``: its rows (None: no
    input was cut)."""

    args: list
    sizes: list


def _parts(n: int, k: int) -> list[int]:
    return [n // k + (1 if i < n % k else 0) for i in range(k)]


def _split_sizes(t: GlobalTensor, k: int) -> list[int]:
    """The rows of each micro-batch of ``t`` when every rank cuts its shard in k balanced
    pieces, checked against the layout (`GraphError` when the pieces are not a layout)."""
    return list(_layout_split_sizes(tuple(t.shape), t.placement, t.sbp, k))


@memoize(1024)
def _layout_split_sizes(shape: tuple, pl, nd: tuple, k: int) -> tuple:
    """`_split_sizes` of a layout (every call of a graph splits the same layouts)."""
    mesh = pl.shape
    rows = {c: _parts(local_shape(shape, mesh, nd, c)[0], k) for c in pl.coords()}
    dims = [d for d, s in enumerate(nd) if isinstance(s, Split) and s.axis == 0]
    origin = (0,) * pl.ndim
    group = [pl.coord_of(r) for r in pl.group(dims, origin)] if dims else [origin]
    sizes = [sum(rows[c][m] for c in group) for m in range(k)]
    for m, n in enumerate(sizes):
        ok = n > 0 and all(local_shape((n,) + shape[1:], mesh, nd, c)[0] == rows[c][m]
                           for c in rows)
        if not ok:
            ways = 1
            for d in dims:
                ways *= mesh[d]
            raise GraphError(
                f"graph: cannot split the input of shape {shape} (sbp {format_nd_sbp(nd)} on "
                f"{pl}) into {k} micro-batches: each rank's {k} pieces must again be a "
                f"balanced layout of each micro-batch and hold at least one row; use a batch "
                f"size that is a multiple of {k * ways} (the micro-batches times the ranks "
                f"splitting the batch), or fewer micro-batches")
    return tuple(sizes)


def _piece(t: GlobalTensor, k: int, m: int, n: int):
    """Micro-batch m (``n`` rows) of ``t``: this rank's piece m of its rows."""
    local = t.local
    if local.dim() and local.numel():
        cut = _parts(local.shape[0], k)
        start = sum(cut[:m])
        local = local[start:start + cut[m]]
    return GlobalTensor(local, (n,) + tuple(t.shape[1:]), t.placement, t.sbp)


def split_inputs(args: Sequence[Any], k: int, split: Sequence[bool] | None) -> MicroBatches:
    """``args`` in ``k`` micro-batches. ``split[i]``: whether input i is cut (default: the
    global tensors whose axis 0 has the first tensor input's size); the others go whole to every
    micro-batch."""
    tensors = [a for a in args if isinstance(a, GlobalTensor) and a.ndim]
    if split is None:
        n0 = tensors[0].shape[0] if tensors else None
        split = [isinstance(a, GlobalTensor) and a.ndim > 0 and a.shape[0] == n0 for a in args]
    elif len(split) != len(args):
        raise GraphError(f"graph: set_split_inputs got {len(split)} flags for {len(args)} "
                         f"inputs")
    cut = [a for a, f in zip(args, split) if f]
    if k == 1 or not cut:  # nothing to cut: every micro-batch gets the inputs whole (the batch
        # may come from a data source in build; `Compiled` checks that something is split)
        return MicroBatches([list(args)] * k, None)
    for a in cut:
        if not isinstance(a, GlobalTensor) or a.ndim == 0 or a.shape[0] != cut[0].shape[0]:
            raise GraphError(f"graph: the inputs split into micro-batches must be global "
                             f"tensors with one batch size on axis 0; got shapes "
                             f"{[tuple(getattr(c, 'shape', ())) for c in cut]}")
    sizes = _split_sizes(cut[0], k)
    for a in cut[1:]:
        if _split_sizes(a, k) != sizes:
            raise GraphError(f"graph: inputs of shapes {tuple(cut[0].shape)} (sbp "
                             f"{format_nd_sbp(cut[0].sbp)}) and {tuple(a.shape)} (sbp "
                             f"{format_nd_sbp(a.sbp)}) split into different micro-batches; "
                             f"lay their batch axis out alike")
    mbs = [[_piece(a, k, m, sizes[m]) if f else a for a, f in zip(args, split)]
           for m in range(k)]
    return MicroBatches(mbs, sizes)


def signature(args: Sequence[Any]) -> tuple:
    """What a compiled plan depends on: each tensor's shape, dtype, placement, sbp and whether
    it requires grad; each other value itself."""
    out = []
    for a in args:
        if isinstance(a, GlobalTensor):
            out.append((tuple(a.shape), a.dtype, a.placement, a.sbp, a.requires_grad))
        elif isinstance(a, torch.Tensor):  # hashed by identity: a new plan every call
            raise GraphError(f"graph: input {len(out)} is a torch.Tensor of shape "
                             f"{tuple(a.shape)}, not a global tensor; give "
                             f"sf.tensor(x, placement, sbp) (a plain tensor would be a "
                             f"constant of the plan, compiled again for every new tensor)")
        else:
            try:
                hash(a)
            except TypeError:
                raise GraphError(f"graph: an input that is not a global tensor must be "
                                 f"hashable (it is a constant of the plan); got "
                                 f"{type(a).__name__}") from None
            out.append((type(a), a))
    return tuple(out)


def _holds_tensor(v: Any) -> bool:
    if isinstance(v, GlobalTensor):
        return True
    items = v.values() if isinstance(v, dict) else v if isinstance(v, (tuple, list)) else ()
    return any(_holds_tensor(x) for x in items)


def _flatten(v: Any, out: list) -> Any:
    """Append ``v``'s leaves to ``out``; its form: None for a leaf, else (container type,
    dict keys or None, the items' forms). Only containers holding a global tensor open."""
    if isinstance(v, (tuple, list, dict)) and _holds_tensor(v):
        keys = tuple(v) if isinstance(v, dict) else None
        items = [v[k] for k in keys] if keys is not None else v
        return (type(v), keys, tuple(_flatten(x, out) for x in items))
    out.append(v)
    return None


def flatten_inputs(inputs: Sequence[Any]) -> tuple[tuple, tuple | None]:
    """A call's inputs as leaves and their form (None: every input is a leaf): a tuple, list,
    namedtuple or dict holding global tensors is its leaves, so its tensors are inputs of the
    plan (split into micro-batches, replaced at each call) and not constants of it."""
    for v in inputs:
        if isinstance(v, (tuple, list, dict)):
            break
    else:  # (no container: the inputs are the leaves, as most calls' are)
        return tuple(inputs), None
    flat: list = []
    forms = tuple(_flatten(v, flat) for v in inputs)
    return tuple(flat), None if all(f is None for f in forms) else forms


def _rebuild(form: Any, leaves) -> Any:
    if form is None:
        return next(leaves)
    kind, keys, parts = form
    items = [_rebuild(p, leaves) for p in parts]
    return kind(zip(keys, items)) if keys is not None else sequence_of(kind, items)


def unflatten_inputs(forms: tuple | None, flat: Sequence[Any]) -> tuple:
    """`flatten_inputs`'s inverse: build's arguments from the leaves."""
    if forms is None:
        return tuple(flat)
    leaves = iter(flat)
    return tuple(_rebuild(f, leaves) for f in forms)
