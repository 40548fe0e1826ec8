"""ZeRO stage 1's gradient reduce-scatters started during backward (docs/zero.md, 'Overlap'), as
`sbpflow.gradsync.GradSync` starts data parallelism's all-reduces: the parameters with a split
update layout go into buckets (reverse registration order, per group and dtype); once every
gradient of a bucket is accumulated, its coalesced reduce-scatter starts on the rank's ZeRO
worker (`sbpflow.optim.zero_comm`), strictly in bucket order. `ShardSync.take` hands the step
the shards whose gradients did not change since (the step reduces the others itself).
``no_sync()`` starts nothing.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterator

import torch

from .. import comm as _comm
from ..gradsync import update_layout
from ..tensor import GlobalTensor
from .zero_layout import geometry, reduce_scatter
from .zero_comm import submit

__all__ = ["ShardSync", "collect"]


class _Bucket:
    __slots__ = ("params", "geos", "ready", "sent", "future")

    def __init__(self) -> None:
        self.params: list = []
        self.geos: list = []
        self.ready: set = set()
        self.sent: list = []     # (gradient, its version) per parameter at the start
        self.future = None


class ShardSync:
    """Overlapped reduce-scatters of the ZeRO stage-1 gradients among ``params``."""

    def __init__(self, params: list, bucket_bytes: int) -> None:
        rank = _comm.rank()
        self._buckets: list[_Bucket] = []
        self._next = 0
        self._enabled = True
        self._handles = []
        owners = _comm.current().state.setdefault("zero_sync_owner", weakref.WeakKeyDictionary())
        filling: dict = {}
        for p in reversed(params):
            lay = update_layout(p)
            if lay == p.sbp or not p.local.requires_grad:
                continue
            geo = geometry(tuple(p.shape), p.placement, p.sbp, lay, rank)
            if geo is None:
                continue
            key = (geo.group, p.local.dtype, p.local.device)
            b = filling.get(key)
            size = p.local.numel() * p.local.element_size()
            if b is None or sum(q.local.numel() * q.local.element_size()
                                for q in b.params) + size > bucket_bytes:
                b = filling[key] = _Bucket()
                self._buckets.append(b)
            b.params.append(p)
            b.geos.append(geo)
            prev = owners.get(p)
            if prev is not None and prev is not self:
                prev.remove()
            owners[p] = self
            self._handles.append(p.local.register_post_accumulate_grad_hook(
                _hook(weakref.ref(self), len(self._buckets) - 1, len(b.params) - 1)))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
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
        if self._next == len(self._buckets):
            self._next = 0

    def _start(self, b: _Bucket) -> None:
        b.ready.clear()
        grads = [p.local.grad for p in b.params]
        if any(g is None for g in grads):
            b.future, b.sent = None, []
            return
        b.sent = [(g, g._version) for g in grads]
        b.future = submit(_reduce, list(zip(grads, b.geos)))

    def take(self) -> dict:
        """``{param: (gradient, version, reduced shard as a global tensor)}`` for the buckets
        started with the current gradients (waiting for them); resets for the next backward."""
        out = {}
        for b in self._buckets:
            if b.future is None:
                continue
            shards = b.future.result()
            if all(p.local.grad is g and g._version == v for p, (g, v) in zip(b.params, b.sent)):
                for p, (g, v), s in zip(b.params, b.sent, shards):
                    out[p] = (g, v, GlobalTensor(s, tuple(p.shape), p.placement,
                                                 update_layout(p)))
            b.future, b.sent = None, []
        for b in self._buckets:
            b.ready.clear()
        self._next = 0
        return out


def collect(params: list) -> dict:
    """`ShardSync.take` of every sync owning one of ``params`` (on this rank)."""
    owners = _comm.current().state.get("zero_sync_owner")
    out: dict = {}
    if not owners:
        return out
    seen: set = set()
    for p in params:
        sync = owners.get(p)
        if sync is not None and id(sync) not in seen:
            seen.add(id(sync))
            out.update(sync.take())
    return out


def _reduce(items: list) -> list:
    with torch.no_grad():
        return reduce_scatter(items)


def _hook(ref: "weakref.ref", index: int, j: int):
    def hook(_local: torch.Tensor) -> None:
        sync = ref()
        if sync is not None:
            sync._ready(index, j)
    # a gradient scaled afterwards (sf.nn.pending_mean) changes version: take() skips it and
    # the step reduces it again
    hook.redone_when_dropped = True
    return hook
