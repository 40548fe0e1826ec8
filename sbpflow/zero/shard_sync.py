"""ZeRO stage 1's gradient reduce-scatters started during backward (docs/zero.md, 'Overlap'), by
the rule `sbpflow.gradsync.GradSync` starts data parallelism's all-reduces by (their shared
base, `sbpflow.gradsync.BucketSync`): the parameters with a split update layout go into buckets
(reverse registration order, per group and dtype); once every gradient of a bucket is
accumulated, its coalesced reduce-scatter starts on the rank's ZeRO worker
(`sbpflow.zero.worker`), strictly in bucket order. `ShardSync.take` hands the step
the shards whose gradients did not change since (the step reduces the others itself).
``no_sync()`` starts nothing.
"""

from __future__ import annotations

import torch

from ..gradsync import Bucket, BucketSync
from ..param_state import update_layout
from ..tensor import GlobalTensor
from .layout import geometry, reduce_scatter
from .worker import submit

__all__ = ["ShardSync", "collect"]


class _Bucket(Bucket):
    __slots__ = ("geos", "nbytes", "sent", "future")

    def __init__(self) -> None:
        super().__init__()
        self.geos: list = []
        self.nbytes = 0
        self.sent: list = []     # (gradient, its version) per parameter at the start
        self.future = None


class ShardSync(BucketSync):
    """Overlapped reduce-scatters of the ZeRO stage-1 gradients among ``params`` (the bucket
    rule is `sbpflow.gradsync.BucketSync`'s)."""

    OWNERS = "zero_sync_owners"

    def __init__(self, params: list, bucket_bytes: int) -> None:
        super().__init__()
        rank = self._comm.rank
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
            if b is None or b.nbytes + size > bucket_bytes:
                b = filling[key] = self._new_bucket(_Bucket())
            b.geos.append(geo)
            b.nbytes += size
            self._add(b, p)

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
        started with the current gradients (waiting for them); resets for the next backward.
        (A gradient scaled after its start, `sf.nn.eager_count_mean`, changed version: the step
        reduces it again.)"""
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
        self.reset()
        return out


def collect(params: list) -> dict:
    """`ShardSync.take` of every sync owning one of ``params`` (on this rank)."""
    return ShardSync.collect(params)


def _reduce(items: list) -> list:
    with torch.no_grad():
        return reduce_scatter(items)
