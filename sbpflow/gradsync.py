"""Gradient all-reduces started during backward, so they overlap the rest of it (what DDP's
reducer does), for the parameters whose gradient boxing ``dual(sbp) -> sbp`` is one all-reduce
(a ``B`` parameter in data parallelism: ``P -> B``).

Parameters go into buckets (reverse registration order, one series per group of ranks); a
bucket's all-reduce starts when all its gradients are ready, strictly in order, and `take`
hands the reduced gradient to the optimizer (None if the gradient changed after its bucket
started). ``no_sync()`` starts nothing. See docs/internals.md, 'Gradient synchronisation'
(bucket sizes and why, buffer reuse, stale results).

A parameter given an *update layout* (ZeRO stage 1, docs/zero.md) has its gradient
reduce-scattered to that layout by the optimizer instead, and is left out here, as is one
reduced at the step only (`sbpflow.param_state`: a parameter's framework state).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterator

import torch

from . import comm as _comm
from .boxing import plan_layouts
from .param_state import reduced_at_step
from .tensor import GlobalTensor
from .utils import IdentityMap

__all__ = ["Bucket", "BucketSync", "GradSync", "collect", "drop_started", "zero_grads"]

FIRST_BUCKET_BYTES = 1 << 20  # the first bucket's size on CUDA (docs/internals.md)
# the shard slot itself: `zero_grads` reads it without waiting for a ZeRO gather in flight
# (`sbpflow.zero.pending` settles on reads of ``GlobalTensor._local``)
_SLOT = GlobalTensor.__dict__["_local"]


class Bucket:
    """Parameters whose gradients one collective reduces: ``params``, ``ready`` (the positions
    of those accumulated in this backward), ``index`` (in its sync's buckets)."""

    __slots__ = ("params", "ready", "index")

    def __init__(self) -> None:
        self.params: list = []
        self.ready: set = set()
        self.index = -1


class BucketSync:
    """The rule both overlapped gradient syncs follow (`GradSync`'s all-reduces, ZeRO-1's
    reduce-scatters in `sbpflow.zero.shard_sync`): parameters in buckets, a hook on each
    local's gradient accumulation; once every gradient of the next bucket in order has been
    accumulated, that bucket starts (`_start`, the subclass's collective), strictly in bucket
    order, so every rank starts the same collectives in the same order. ``no_sync()`` starts
    nothing. A later sync of the same class over a parameter takes it over (``OWNERS``: the
    ``comm.per_rank`` field of parameter -> the sync acting for it)."""

    OWNERS = "grad_sync_owners"

    def __init__(self) -> None:
        self._comm = _comm.current()
        self._buckets: list = []
        self._next = 0            # index of the next bucket to start, in order
        self._enabled = True
        self._handles: dict = {}

    def _new_bucket(self, b: Bucket) -> Bucket:
        b.index = len(self._buckets)
        self._buckets.append(b)
        return b

    def _add(self, b: Bucket, p: GlobalTensor) -> None:
        """Put ``p`` in bucket ``b`` (made by `_new_bucket`) and act for it from now on."""
        b.params.append(p)
        owners = _owners(self._comm, self.OWNERS)
        prev = owners.get(p)
        if prev is not None and prev is not self:
            prev._release(p)
        owners[p] = self
        self._handles[p] = p.local.register_post_accumulate_grad_hook(
            _hook(weakref.ref(self), b.index, len(b.params) - 1))

    def _release(self, p: GlobalTensor) -> None:
        handle = self._handles.pop(p, None)
        if handle is not None:
            handle.remove()

    @property
    def params(self) -> list:
        return [p for b in self._buckets for p in b.params]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside start no collective (micro-batches being accumulated)."""
        prev, self._enabled = self._enabled, False
        try:
            yield
        finally:
            self._enabled = prev

    def _ready(self, index: int, j: int) -> None:
        if not self._enabled:
            return
        self._buckets[index].ready.add(j)
        while self._next < len(self._buckets) and \
                len(self._buckets[self._next].ready) == len(self._buckets[self._next].params):
            self._start(self._buckets[self._next])
            self._next += 1
        if self._next == len(self._buckets):  # every bucket started: the next backward begins anew
            self._next = 0

    def _start(self, b: Bucket) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        """Forget readiness marks (a backward that did not reach every parameter)."""
        for b in self._buckets:
            b.ready.clear()
        self._next = 0

    @classmethod
    def collect(cls, params: list) -> dict:
        """``take()`` of every sync of this class owning one of ``params`` (on this rank)."""
        owners = getattr(_comm.current().per_rank, cls.OWNERS)
        out: dict = {}
        if not owners:
            return out
        # the sync is the latest to act for p (a takeover overwrites it)
        syncs: dict = {}   # in the order of ``params``, as every rank calls them
        for p in params:
            sync = owners.get(p)
            if sync is not None:
                syncs.setdefault(id(sync), sync)
        for sync in syncs.values():
            out.update(sync.take())
        return out


class _Bucket(Bucket):
    __slots__ = ("group", "op", "limit", "nbytes", "pending", "sent", "flat", "spare")

    def __init__(self, group: tuple, op: str, limit: int) -> None:
        super().__init__()
        self.group, self.op, self.limit, self.nbytes = group, op, limit, 0
        self.pending = None       # Pending of the flat all-reduce
        self.sent: list | None = []  # (gradient, its version) at the start, per param; None:
                                     # dropped (the all-reduce is drained, its result unused)
        self.flat = None          # the flat buffer, reused while nothing else holds a view of it
        self.spare = None         # the buffer before it, if ``flat`` was busy when last needed


class GradSync(BucketSync):
    """Overlapped all-reduce of the all-reduce-boxed gradients of ``params`` (see the module
    docstring and `BucketSync`)."""

    def __init__(self, params: list, bucket_bytes: int,
                 first_bucket_bytes: int | None = None) -> None:
        super().__init__()
        rank = self._comm.rank
        filling: dict = {}        # (group, op, dtype, device) -> the bucket being filled
        for p in reversed(params):
            found = self._single_all_reduce(p, rank)
            if found is None:
                continue
            step, group = found
            key = (group, step.op, p.local.dtype, p.local.device)
            size = p.local.numel() * p.local.element_size()
            b = filling.get(key)
            if b is None or (b.params and b.nbytes + size > b.limit):
                # the first bucket of each group: its members must cut the same buckets, and
                # another group's buckets are made on some of them only
                first = first_bucket_bytes if first_bucket_bytes is not None else \
                    FIRST_BUCKET_BYTES if p.local.device.type == "cuda" else bucket_bytes
                b = filling[key] = self._new_bucket(
                    _Bucket(group, step.op, bucket_bytes if b else first))
            b.nbytes += size
            self._add(b, p)

    @staticmethod
    def _single_all_reduce(p: GlobalTensor, rank: int):
        """(the one all-reduce step of ``p``'s gradient boxing, this rank's group of it) when
        that group is more than this rank, else None."""
        if not p.local.requires_grad or reduced_at_step(p):
            return None
        lay = p.global_layout
        plan = plan_layouts(tuple(p.shape), p.local.dtype, lay.dual(), lay)
        group = plan.all_reduce_group(rank)
        return None if group is None or len(group) == 1 else (plan.steps[0], group)

    # -- during backward ----------------------------------------------------------------------
    def _start(self, b: _Bucket) -> None:
        b.ready.clear()
        grads = [p.local.grad for p in b.params]
        if any(g is None for g in grads):
            b.pending, b.sent = None, []
            return
        if b.pending is not None:
            b.pending.wait()      # a stale earlier start (accumulation): let it finish first
        with torch.no_grad():
            flat = _reusable(b.flat, grads)
            if flat is None:      # busy (held, or not yet let go by the backend): the one before
                flat = _reusable(b.spare, grads)
                b.spare = b.flat
            flat = b.flat = torch.cat([g.reshape(-1) for g in grads], out=flat)
        b.sent = [(g, g._version) for g in grads]
        b.pending = self._comm.all_reduce_start(flat, b.group, b.op, inplace=True)

    def drop_started(self) -> None:
        """Forget the results of the all-reduces started so far (their gradients were wrong:
        see `sf.nn.eager_count_mean`); `take` then drains them and returns nothing for them. Every
        rank must drop the same ones, since the caller reduces those gradients again."""
        for b in self._buckets:
            if b.pending is not None:
                b.sent = None

    # -- at the optimizer step ----------------------------------------------------------------
    def take(self) -> dict:
        """``{param: (gradient, its version, reduced gradient in the param's layout)}`` for every
        parameter whose bucket was started with its current gradient (waiting for buckets in
        flight); clears the state for the next backward."""
        out = {}
        for b in self._buckets:
            if b.pending is None:
                continue
            reduced = b.pending.wait()
            sent = b.sent
            if sent is not None and all(p.local.grad is g and g._version == v
                                        for p, (g, v) in zip(b.params, sent)):
                # views of the reduced buffer shaped as the gradients, in one call
                pieces = _unflatten(reduced, [g for g, _ in sent])
                for p, (g, v), piece in zip(b.params, sent, pieces):
                    out[p] = (g, v, GlobalTensor(piece, p._shape, p.placement, p.sbp))
            b.pending, b.sent = None, []
        self.reset()
        return out


_use_count = getattr(torch._C, "_storage_Use_Count", None)
_unflatten = torch._C._nn.unflatten_dense_tensors


def _reusable(flat: torch.Tensor | None, grads: list) -> torch.Tensor | None:
    """The bucket's previous flat buffer, if the next concatenation may overwrite it: same
    dtype and device, and no view of it alive (the reduced gradients handed out by `take`
    are views: while a caller keeps one, a fresh buffer is used). Reusing it saves allocating
    (and page-faulting in) the bucket's bytes every step."""
    if flat is None or _use_count is None or flat.dtype != grads[0].dtype or \
            flat.device != grads[0].device:
        return None
    # references: ``flat`` itself and the storage object made for the call
    return flat if _use_count(flat.untyped_storage()._cdata) == 2 else None


def _owners(comm, key: str) -> IdentityMap:
    """This rank's map parameter -> the sync of class ``key`` acting for it."""
    return getattr(comm.per_rank, key)


def collect(params: list) -> dict:
    """`GradSync.take` of every sync owning one of ``params`` (on this rank)."""
    return GradSync.collect(params)


def drop_started() -> None:
    """`GradSync.drop_started` of every sync of this rank."""
    seen: set = set()
    for sync in list(_owners(_comm.current(), GradSync.OWNERS).values()):
        if id(sync) not in seen:
            seen.add(id(sync))
            sync.drop_started()


def _hook(sync_ref: "weakref.ref", index: int, j: int):
    def hook(_local: torch.Tensor) -> None:
        sync = sync_ref()
        if sync is not None:
            sync._ready(index, j)
    # what it starts is undone when a gradient is scaled afterwards (sf.nn.eager_count_mean):
    # `drop_started` (all-reduces), or a changed version `take` skips (reduce-scatters)
    hook.redone_when_dropped = True
    return hook


def zero_grads(params, set_to_none: bool = True) -> None:
    """Drop (or zero in place) the gradients of ``params`` (global tensors). Their values are
    not read, so a ZeRO-1/2 parameter still being gathered is not waited for (the slot is read
    as it is: `zero_grad` right after the step keeps the gather overlapping the next forward)."""
    for p in params:
        local = _SLOT.__get__(p, type(p))
        if local.grad is None:
            continue
        if set_to_none:
            local.grad = None
        else:
            local.grad.detach_().zero_()
