"""ZeRO stages 1-3 on a laid-out model (docs/zero.md): `shard` (and ``sf.parallel.apply(...,
zero=)``) store, along each parameter's data-parallel dims, its optimizer state (1), gradient
(2) and the parameter itself (3) split; `sbpflow.optim.zero` has the layouts and the hooks.

What this module adds is stage 3's *release*: while a module that owns stage-3 parameters runs
its ``forward``, torch's saved-tensor hooks replace every saved view of a boxed (gathered)
weight by a token, so the gathered copy is freed when the call ends; backward boxes the weight
again when an op first unpacks it (freed once its ops are done). Other saved tensors go to the
hooks that were active before (activation checkpointing, `sf.memory.track`). The gathered bytes
count as ``"gathered"`` in the `sf.memory.track` blocks around the call while they are held.
Not in a graph's trace: the graph keeps the boxed weights from forward to backward (stage 2).
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch

from .. import memory as _memory
from ..nn.modules import Module
from ..optim import zero as _core
from ..tensor import recording

__all__ = ["shard", "stored_layout", "check_stage", "STAGES"]

stored_layout = _core.stored_layout
check_stage = _core.check_stage
STAGES = _core.STAGES


def shard(model: Module, stage: int, min_size: int = 0, *, compute: dict | None = None) -> list:
    """ZeRO ``stage`` (0-3) on ``model``, in place (the parameter objects stay the same); see
    `sbpflow.optim.zero.shard_`. Returns the names of the parameters it shards. Every rank
    calls it, before the first step."""
    return _core.shard_(model, stage, min_size, compute=compute, release=_release)


def _release(swapped: list):
    """Stage 3's context over one module call (None in a graph's trace: replays keep them)."""
    return None if recording() else _FreeAfterUse(swapped)


def _top_hooks():
    """The saved-tensor hooks active now (pack, unpack), or None."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(False) if top is not None else None


def _storage(t: torch.Tensor):
    """(key as `sf.memory` counts storages, bytes) of ``t``'s storage, or None."""
    if t.device.type == "meta" or t.numel() == 0:
        return None
    try:
        s = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return (t.device, s.data_ptr()), s.nbytes()


def _hold(trackers, found) -> None:
    # Tracker's counters (sbpflow.memory): a gathered weight is held, not saved by an op
    for tr in trackers:
        tr._add(found[0], found[1], "gathered")


def _let_go(trackers, key) -> None:
    for tr in trackers:
        tr._release(key)


class _Outer(NamedTuple):
    value: object      # what the enclosing hooks' pack returned


class _Token(NamedTuple):
    """A saved view of a gathered weight: enough to box the weight again and re-make the view."""

    owner: "_FreeAfterUse"
    param: object
    compute: tuple
    size: tuple
    stride: tuple
    offset: int        # storage offset relative to the gathered tensor's
    base_stride: tuple

    def restore(self) -> torch.Tensor:
        base = self.owner.regather(self.param, self.compute, self.base_stride)
        return base.as_strided(self.size, self.stride, base.storage_offset() + self.offset)


class _FreeAfterUse:
    """Saved-tensor hooks over one module call holding stage-3 parameters ``swapped``
    ((parameter, its gathered global tensor) pairs)."""

    def __init__(self, swapped: list) -> None:
        self.gathered: dict = {}     # storage key -> (parameter, compute layout, local)
        for p, g in swapped:
            local = g.local
            found = _storage(local)
            # only a gathered tensor that owns its whole storage (never the shard itself)
            if found is None or found[1] != local.numel() * local.element_size() or \
                    _storage(p.local) == found:
                continue
            self.gathered[found[0]] = (p, tuple(g.sbp), local, found)
        self.trackers = _memory.active_trackers()
        self.regathered: dict = {}   # id(parameter) -> weakref to its backward copy
        self.outer = None
        self.hooks = None

    def __enter__(self) -> "_FreeAfterUse":
        self.outer = _top_hooks()
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self.hooks.__enter__()
        for *_, found in self.gathered.values():
            _hold(self.trackers, found)
        return self

    def __exit__(self, *exc) -> None:
        self.hooks.__exit__(*exc)
        for *_, found in self.gathered.values():
            _let_go(self.trackers, found[0])
        self.gathered = {}           # the gathered copies are freed with the call's references

    def _pack(self, t: torch.Tensor):
        if self.gathered:
            found = _storage(t)
            hit = self.gathered.get(found[0]) if found is not None else None
            if hit is not None and hit[2].dtype == t.dtype:
                p, compute, base, _ = hit
                return _Token(self, p, compute, tuple(t.size()), tuple(t.stride()),
                              t.storage_offset() - base.storage_offset(), tuple(base.stride()))
        if self.outer is not None:
            return _Outer(self.outer[0](t))
        return t.detach()

    def _unpack(self, packed):
        if isinstance(packed, _Token):
            return packed.restore()
        if isinstance(packed, _Outer):
            return self.outer[1](packed.value)
        return packed

    def regather(self, p, compute: tuple, stride: tuple) -> torch.Tensor:
        """``p`` boxed to ``compute`` again (one copy per backward while an op holds it)."""
        ref = self.regathered.get(id(p))
        base = ref() if ref is not None else None
        if base is not None:
            return base
        with torch.no_grad():
            base = p.to_global(p.placement, compute).local
            if tuple(base.stride()) != stride:
                base = torch.empty_strided(base.shape, stride, dtype=base.dtype,
                                           device=base.device).copy_(base)
        self.regathered[id(p)] = weakref.ref(base)
        found = _storage(base)
        if found is not None and self.trackers:
            _hold(self.trackers, found)
            weakref.finalize(base, _let_go, self.trackers, found[0])
        return base
