"""What ZeRO needs of `sf.memory` (docs/zero.md): a unit's gathered buffers count as
``"gathered"`` in the `sf.memory.track` blocks around the call while they are alive, and
stage 3's *release*: during the unit's ``forward``, saved-tensor hooks replace every saved view
of a gathered buffer by a token, so the buffer is freed when the call ends; backward gathers
the unit again when an op first unpacks one (freed after the unit's reduce-scatter). Other
saved tensors go to the hooks active before (activation checkpointing, `sf.memory.track`).
`on_gather` is every unit's default (`units.set_default_on_gather`). Not in a graph's trace.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch

from .. import memory as _memory
from . import gather as _gather
from . import units as _units

__all__ = ["on_gather"]


def on_gather(call) -> "_FreeAfterUse | None":
    """Count the call's buffers as gathered while alive; stage 3: its release context; stage
    2 with whole copies kept: hooks that keep their saved views out of `sf.memory.track`
    (they are parameters, which `sf.memory_stats` counts)."""
    trackers = _memory.active_trackers()
    if trackers:
        for flat in call.flats:
            _hold_while_alive(trackers, flat)
    rec = _units.zero_param(call.items[0][0])
    if rec.stage == 3:
        return _FreeAfterUse(call, trackers)
    if rec.whole is not None and trackers:
        return _FreeAfterUse(call, trackers, keep=[_units.zero_param(p).whole
                                                   for p, _ in call.items])
    return None


_units.set_default_on_gather(on_gather)   # a graph's enable_zero shards with it too


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


def _hold_while_alive(trackers, flat: torch.Tensor) -> None:
    """Count ``flat`` in ``trackers`` as gathered until it is freed (Tracker's counters,
    `sbpflow.memory`: a gathered buffer is held for use, not saved by an op)."""
    found = _storage(flat)
    if found is None:
        return
    for tr in trackers:
        tr.hold(found[0], found[1], "gathered")
    weakref.finalize(flat, _let_go, trackers, found[0])


def _let_go(trackers, key) -> None:
    for tr in trackers:
        tr.release(key)


class _Outer(NamedTuple):
    value: object      # what the enclosing hooks' pack returned


class _Token(NamedTuple):
    """A saved view of a gathered buffer: which buffer of the call, and the view's geometry."""

    call: object
    index: int
    size: tuple
    stride: tuple
    offset: int


class _FreeAfterUse:
    """Saved-tensor hooks over one unit call (`UnitCall`): views of its gathered buffers become
    tokens (stage 3), views of ``keep`` (stage 2's whole copies) are saved as they are."""

    def __init__(self, call, trackers, keep: list = ()) -> None:
        self.call, self.trackers = call, trackers
        self.flats = {_storage(f)[0]: i for i, f in enumerate(call.flats) if _storage(f)}
        self.keep = {_storage(w)[0] for w in keep if _storage(w) is not None}
        self.outer = None
        self.hooks = None

    def __enter__(self) -> "_FreeAfterUse":
        self.outer = _top_hooks()
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.hooks.__exit__(*exc)

    def _pack(self, t: torch.Tensor):
        found = _storage(t) if self.flats or self.keep else None
        if found is not None and found[0] in self.keep:
            return t.detach()
        i = self.flats.get(found[0]) if found is not None else None
        if i is not None and self.call.flats[i].dtype == t.dtype:
            self.call.tokens += 1
            return _Token(self.call, i, tuple(t.size()), tuple(t.stride()), t.storage_offset())
        if self.outer is not None:
            return _Outer(self.outer[0](t))
        return t.detach()

    def _unpack(self, packed):
        if isinstance(packed, _Token):
            flat = _regathered(packed.call, self.trackers)[packed.index]
            return flat.as_strided(packed.size, packed.stride, packed.offset)
        if isinstance(packed, _Outer):
            return self.outer[1](packed.value)
        return packed


def _regathered(call, trackers) -> list:
    """The call's buffers gathered again for backward (once; kept until its reduce-scatter
    starts), and the gather of the call before it (backward's next) started."""
    if call.regathered is None:
        call.regathered = _gather.start(call.items)
    prev = call.prev() if call.prev is not None else None
    if prev is not None and prev.tokens and prev.regathered is None:
        prev.regathered = _gather.start(prev.items)
    if not isinstance(call.regathered, list):
        call.regathered = call.regathered.result()[1]
        if trackers:
            for flat in call.regathered:
                _hold_while_alive(trackers, flat)
    return call.regathered
