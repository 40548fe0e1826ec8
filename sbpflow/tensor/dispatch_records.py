"""What the dispatch (`apply_op` in tensor/dispatch.py) keeps and checks: the entry of
its cache of choices per call (`_Entry`), the boxed versions of a tensor kept for the next
consumer (`_Boxed`), the small int naming a layout that the cache key holds
(`_intern_layout`), a rank's kernel context, torch's autocast dtype, the same-dtype check, and
the empty shard of a rank outside a placement that still hangs off the autograd graph.

Each reads a tensor's metadata only, never runs an op.
"""

from __future__ import annotations

import itertools
import weakref
from typing import NamedTuple

import torch

from ..caches import BoundedDict
from ..errors import DtypeMismatchError
from ..ops import Choice, KernelContext, Op
from ..placement import Placement
from ..sbp import format_nd_sbp, shard_box
from .hooks import _tracing

__all__: list = []


class _Entry(NamedTuple):
    """What the dispatch keeps per (op, input layouts, placement, attributes)."""

    choice: Choice
    op: Op
    detach: bool            # outputs are P(max)/P(min): no gradient
    out_keys: tuple         # each output's layout key
    moves: bool             # some input is boxed first
    contexts: dict          # rank -> its KernelContext (made on first use)
    mixed: bool             # a same-dtype op got several input dtypes: checked on each call


_CHOICES = BoundedDict("tensor.dispatch_choices")

class _Boxed(NamedTuple):
    """A boxed version of a tensor, valid while the tensor's shard is the same object at the
    same version (an in-place op or an optimizer update bumps it) and the grad mode is the
    same. ``kept`` holds the boxed shard for a value (an activation, an input); for a
    parameter (a leaf that requires grad) only ``ref`` does, weakly: a gathered weight is
    reused while backward keeps it anyway, never kept alive by the cache (ZeRO frees it)."""

    source: "weakref.ref"
    version: int
    grad: bool
    kept: torch.Tensor | None
    ref: "weakref.ref"
    trace: "weakref.ref | None"  # the graph recorder it was made under: a trace reuses only
    # its own boxings (recorded), eager only eager ones


def _same_trace(trace: "weakref.ref | None") -> bool:
    rec = _tracing.recorder
    return rec is None if trace is None else (rec is not None and trace() is rec)


def _rank_context(entry: _Entry, tensors: list, pl: Placement, me: int) -> KernelContext:
    """This rank's `KernelContext` for the entry (it depends only on the entry and the rank:
    made once, kept in the entry)."""
    choice = entry.choice
    coord = pl.coord_of(me)
    ctx = entry.contexts[me] = KernelContext(
        pl, coord,
        tuple(shard_box(t._shape, pl.shape, nd, coord) for t, nd in zip(tensors, choice.ins)),
        tuple(shard_box(m.shape, pl.shape, nd, coord)
              for m, nd in zip(choice.out_metas, choice.outs)),
        choice.ins, choice.outs, tuple(t._shape for t in tensors))
    return ctx


# (shape, dtype, nd-sbp) -> a small int, so the dispatch key hashes ints instead of nested
# tuples of sbp values. Ids come from a counter (atomic under the GIL: rank threads may intern
# at once); a layout may get two ids after a clear, which costs a cache miss, never a wrong hit.
_LAYOUT_KEYS = BoundedDict("tensor.layout_keys")
_LAYOUT_IDS = itertools.count(1)


def _intern_layout(shape: tuple, dtype: torch.dtype, sbp: tuple) -> int:
    key = _LAYOUT_KEYS.get((shape, dtype, sbp))
    return key if key is not None else \
        _LAYOUT_KEYS.setdefault((shape, dtype, sbp), next(_LAYOUT_IDS))


def _check_dtypes(name: str, tensors: list, pl: Placement) -> None:
    """Raise `DtypeMismatchError` unless the inputs of same-dtype op ``name`` have one dtype
    once torch's autocast has cast them (it casts floating inputs other than float64 to its
    dtype). Every rank of the placement reaches the same verdict: it reads only metadata."""
    cast = _autocast_dtype(name, pl)
    dtypes = [cast if cast is not None and t.dtype.is_floating_point and t.dtype != torch.float64
              else t.dtype for t in tensors]
    if len(set(dtypes)) > 1:
        shown = "; ".join(f"{t.dtype} ({_describe(t)})" for t in tensors)
        first = tensors[0].dtype
        raise DtypeMismatchError(
            f"{name}: inputs must have one dtype, as in torch (which does not promote here); got "
            f"{shown}. Cast with .to({first}) (or another common dtype) first")


# Ops that torch's autocast runs in the lower precision. Output metadata comes from meta
# kernels, which autocast does not cast, so a rank outside the placement (which runs no kernel)
# takes the autocast dtype from here to hold the same dtype as the ranks that ran it.
_AUTOCAST_LOWER = frozenset({"matmul", "linear", "conv2d"})


def _autocast_dtype(name: str, pl: Placement) -> torch.dtype | None:
    if name in _AUTOCAST_LOWER and torch.is_autocast_enabled(pl.device_type):
        return torch.get_autocast_dtype(pl.device_type)
    return None


def _describe(t: GlobalTensor) -> str:
    return f"shape {t._shape} on {t._placement} with sbp {format_nd_sbp(t._sbp)}"


def _connected_empty(inputs: list, dtype: torch.dtype) -> torch.Tensor:
    """An empty shard for a rank outside the placement that still hangs off the inputs in the
    autograd graph, so backward reaches (and runs the collectives of) earlier boxing steps."""
    parts = [t._local.reshape(-1)[:0] for t in inputs if t._local.requires_grad]
    if not parts or not dtype.is_floating_point:
        return torch.empty(0, dtype=dtype, device=inputs[0]._local.device)
    return torch.cat([p.to(dtype) for p in parts])[:0]
