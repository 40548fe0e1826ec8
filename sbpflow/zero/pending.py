"""Shards completed in the background (docs/zero.md, 'Overlap'): after the update of a ZeRO
stage-1/2 parameter the optimizer all-gathers the other members' shards on the ZeRO worker
(`set_pending`), and `settle` waits for them; so does the next read or write of the shard
(``p.local``, an op on ``p``): until then ``p`` is of a twin of its class whose shard
attribute settles first. Every read of a shard goes through the slot ``GlobalTensor._local``,
so a class attribute of that name in a subclass with the same slots sees them all; the object
(its identity, hash, registrations) stays the same and is of its own class again once settled.
"""

from __future__ import annotations

from .. import comm as _comm
from ..param_state import mark_filled, take_stale as _take_stale
from ..tensor import GlobalTensor

__all__ = ["set_pending", "settle", "take_stale"]

_SLOT = GlobalTensor.__dict__["_local"]
_TWINS: dict = {}    # class -> its settling twin
_BASES: dict = {}    # twin -> class


def set_pending(p: GlobalTensor, future) -> None:
    """``p``'s shard is being completed in the background by ``future``: `settle` waits for
    it, and so does the next read or write of ``p``'s shard."""
    _comm.current().per_rank.pending_gathers[p] = future
    if type(p) not in _BASES:
        p.__class__ = _settling(type(p))


def settle(params=None) -> None:
    """Wait for the background completions of ``params`` (default: all of this rank's)
    before their values are read or written."""
    pending = _comm.current().per_rank.pending_gathers
    if not pending:
        return
    for p in list(pending) if params is None else params:
        fut = pending.pop(p, None)
        if fut is not None:
            base = _BASES.get(type(p))
            if base is not None:
                p.__class__ = base
            fut.result()
            mark_filled(p)


def take_stale(params) -> list:
    """`sbpflow.param_state.take_stale` after waiting for ``params``' gathers in flight."""
    settle(params)
    return _take_stale(params)


def _settle_one(p: GlobalTensor) -> None:
    pending = _comm.current().per_rank.pending_gathers
    fut = pending.pop(p, None) if pending else None
    base = _BASES.get(type(p))
    if base is not None:
        p.__class__ = base
    if fut is not None:
        fut.result()
        mark_filled(p)


def _settling(cls: type) -> type:
    twin = _TWINS.get(cls)
    if twin is None:
        def read(self):
            _settle_one(self)
            return _SLOT.__get__(self, type(self))

        def write(self, value):
            _settle_one(self)
            _SLOT.__set__(self, value)

        twin = type(cls.__name__, (cls,), {"__slots__": (), "_local": property(read, write),
                                           "__module__": cls.__module__, "__doc__": cls.__doc__})
        _TWINS[cls], _BASES[twin] = twin, cls
    return twin
