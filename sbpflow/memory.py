"""What one rank holds, measured: `memory_stats` (parameters, gradients, optimizer state) and
`track` (tensors saved for backward and parameters gathered for use, at their peak).

    with sf.memory.track() as mem:
        loss = model(x, y); loss.backward(); opt.step()
    sf.memory_stats(model, opt)   # {"params": ..., "grads": ..., "optimizer": ..., "total": ...}
    mem.peak, mem.peak_by_kind    # bytes, {"saved": ..., "gathered": ...}

Bytes are of this rank's local shards, each underlying storage counted once (tied parameters,
views and shared buffers are not counted twice; a view counts its whole storage, which is what
it keeps alive). Saved tensors are seen through torch's saved-tensor hooks, which are
thread-local: each rank thread has its own trackers. See docs/memory.md, 'What is counted'.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterable, Iterator

import torch
from torch.autograd.function import BackwardCFunction

from . import comm as _comm
from .boxing.executor import _StepFunction
from .tensor import GlobalTensor

__all__ = ["memory_stats", "track", "Tracker", "KINDS", "active_trackers", "attach",
           "storage_key", "saved_tensors"]

KINDS = ("saved", "gathered")  # the kinds `track` counts


# -- what a rank holds between steps -----------------------------------------------------------
def storage_key(t: torch.Tensor) -> tuple | None:
    """(device, storage address) and the storage's bytes; None for a tensor holding no memory
    (a meta tensor, an empty shard): how a `Tracker` names what it holds."""
    if t.is_meta:
        return None
    try:
        s = t.untyped_storage()
    except (RuntimeError, NotImplementedError):   # no plain storage (sparse, ...): its bytes
        n = t.numel() * t.element_size()
        return ((t.device, "id", id(t)), n) if n else None
    n = s.nbytes()
    return ((t.device, s.data_ptr()), n) if n else None


class _Bytes:
    """Bytes by category, each storage counted once over all categories (the first claims it)."""

    def __init__(self) -> None:
        self.seen: set = set()
        self.out = {"params": 0, "grads": 0, "optimizer": 0}

    def add(self, category: str, t: torch.Tensor | None) -> None:
        if t is None:
            return
        found = storage_key(t)
        if found is None or found[0] in self.seen:
            return
        self.seen.add(found[0])
        self.out[category] += found[1]


def _parameters(model, optimizers: list) -> list:
    """The parameters to count: ``model``'s (a module, or an iterable of global tensors), else
    those of the optimizers' parameter groups; each object once, in order."""
    if model is None:
        params = [p for opt in optimizers for g in opt.param_groups for p in g["params"]]
    elif hasattr(model, "parameters"):
        params = list(model.parameters())
    else:
        params = list(model)
    seen, out = set(), []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _state_tensors(value) -> Iterator[torch.Tensor]:
    """The local tensors in one optimizer-state value (a global tensor, a torch tensor, or a
    list / tuple / dict of them; numbers such as Adam's int ``step`` hold no tensor)."""
    if isinstance(value, GlobalTensor):
        yield value.local
    elif isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _state_tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _state_tensors(v)


def memory_stats(model=None, optimizer=None) -> dict:
    """Bytes this rank holds: ``{"params", "grads", "optimizer", "total"}``.

    ``params``: the local shards of ``model``'s parameters (an ``sf.nn.Module`` or an iterable
    of global tensors; without a model, the optimizer's parameters); ``grads``: their local
    gradients (``p.local.grad``); ``optimizer``: the local shards of every tensor in
    ``optimizer.state`` (one optimizer or a sequence of them). Each storage is counted once,
    whole (docs/memory.md, 'What is counted'). Local: no communication, any rank may call it."""
    if optimizer is None:
        optimizers = []
    elif isinstance(optimizer, (list, tuple)):
        optimizers = list(optimizer)
    else:
        optimizers = [optimizer]
    params = _parameters(model, optimizers)
    b = _Bytes()
    for p in params:
        b.add("params", p.local if isinstance(p, GlobalTensor) else p)
    for p in params:
        local = p.local if isinstance(p, GlobalTensor) else p
        b.add("grads", local.grad)
    for opt in optimizers:
        for state in opt.state.values():
            for v in state.values():
                for t in _state_tensors(v):
                    b.add("optimizer", t)
    out = dict(b.out)
    out["total"] = sum(out.values())
    return out


# -- what a step holds at its peak ---------------------------------------------------------------
class Tracker:
    """Bytes held by tensors saved for backward inside a `track` block, by kind: ``"saved"``
    (activations and other tensors autograd keeps) and ``"gathered"`` (a parameter boxed to
    another layout for an op, kept for backward). ``current`` / ``current_by_kind``: held now;
    ``peak`` / ``peak_by_kind``: the largest total, and each kind's own largest (they need not
    coincide). ``cuda_max_allocated``: ``torch.cuda.max_memory_allocated`` of this rank's
    device over the block (None off CUDA). ``rank``: the rank that made it."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.current = 0
        self.peak = 0
        self.current_by_kind = dict.fromkeys(KINDS, 0)
        self.peak_by_kind = dict.fromkeys(KINDS, 0)
        self.cuda_max_allocated: int | None = None
        self._held: dict = {}          # storage key -> [references, bytes, kind]
        # releases come from other threads (autograd's) and from the garbage collector, which
        # may run inside `hold` on this thread (a freed storage's finalizer): reentrant
        self._lock = threading.RLock()

    def hold(self, key: tuple, nbytes: int, kind: str) -> None:
        """Count storage ``key`` (``nbytes``) as held, of ``kind`` (one of `KINDS`), until as
        many `release` calls as holds; a storage is counted once however often it is held."""
        with self._lock:
            entry = self._held.get(key)
            if entry is not None:
                entry[0] += 1
                return
            self._held[key] = [1, nbytes, kind]
            now = self.current = self.current + nbytes
            if now > self.peak:
                self.peak = now
            now = self.current_by_kind[kind] = self.current_by_kind[kind] + nbytes
            if now > self.peak_by_kind[kind]:
                self.peak_by_kind[kind] = now

    def release(self, key: tuple) -> None:
        """One `hold` of storage ``key`` ends (unknown keys are ignored)."""
        with self._lock:
            entry = self._held.get(key)
            if entry is None:
                return
            entry[0] -= 1
            if entry[0] == 0:
                del self._held[key]
                self.current -= entry[1]
                self.current_by_kind[entry[2]] -= entry[1]

    def __repr__(self) -> str:
        cuda = "" if self.cuda_max_allocated is None else \
            f", cuda_max_allocated={self.cuda_max_allocated}"
        return (f"Tracker(rank={self.rank}, peak={self.peak}, current={self.current}, "
                f"peak_by_kind={self.peak_by_kind}{cuda})")


class _Active(threading.local):
    trackers: list = []   # per thread: the trackers of the enclosing `track` blocks


_active = _Active()


class _Held:
    """What the pack hook hands autograd: the saved tensor (detached: holding it with its
    grad_fn would make a reference cycle through autograd's graph) and, while autograd keeps
    this object, one reference on its storage in each tracker."""

    __slots__ = ("tensor", "key", "trackers")

    def __init__(self, tensor: torch.Tensor, key, trackers: list) -> None:
        self.tensor, self.key, self.trackers = tensor, key, trackers

    def __del__(self) -> None:
        for t in self.trackers:
            t.release(self.key)


def _parameter_of(base: torch.Tensor) -> torch.Tensor | None:
    """The parameter shard ``base`` was boxed from, if it is the output of a chain of boxing
    steps starting at a leaf that requires grad (the gradient flows back to its AccumulateGrad)."""
    node = base.grad_fn
    # (a custom Function's node is a BackwardCFunction; asking torch's own nodes for
    # ``_forward_cls`` would raise and catch an AttributeError for every saved tensor)
    while isinstance(node, BackwardCFunction) and node._forward_cls is _StepFunction:
        node = node.next_functions[0][0]
    return getattr(node, "variable", None) if node is not None else None


def _classify(t: torch.Tensor) -> str | None:
    """``"saved"``, ``"gathered"``, or None for a parameter's own storage (counted by
    `memory_stats`, not held for backward)."""
    base = t._base
    if base is None:
        base = t
    if base.is_leaf:
        return None if base.requires_grad else "saved"
    param = _parameter_of(base)
    if param is None:
        return "saved"
    own = storage_key(param)
    mine = storage_key(t)
    return None if own is not None and mine is not None and own[0] == mine[0] else "gathered"


def _pack(t: torch.Tensor):
    # the hooks run for every tensor autograd saves while a tracker is attached: kept short
    trackers = _active.trackers  # (replaced by `attach`, never changed in place: kept as is)
    kind = _classify(t) if trackers else None
    found = storage_key(t) if kind is not None else None
    if found is None:
        return t.detach()
    key, nbytes = found
    for tr in trackers:
        tr.hold(key, nbytes, kind)
    return _Held(t.detach(), key, trackers)


def _unpack(packed):
    return packed.tensor if isinstance(packed, _Held) else packed


def saved_tensors(out: torch.Tensor) -> list[torch.Tensor]:
    """The tensors autograd saved for the backward of ``out``'s graph, read from each node's
    ``_saved_*`` attributes, down to its leaves (the graph's saves, as the pack hook sees them
    as they are made: for a graph made without a tracker attached)."""
    found, seen, todo = [], set(), [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        for name in dir(node):
            if name.startswith("_saved_"):
                value = getattr(node, name)
                items = value if isinstance(value, (list, tuple)) else (value,)
                found += [v for v in items if isinstance(v, torch.Tensor)]
        todo += [nxt for nxt, _ in node.next_functions]
    return found


@contextlib.contextmanager
def track() -> Iterator[Tracker]:
    """Count the tensors saved for backward by the ops this rank thread runs inside the block
    (forward passes; each storage once while autograd holds it). Blocks nest: an outer tracker
    sees what inner ones see. Regions under other saved-tensor hooks (activation
    checkpointing) are not seen: they hold no saved tensors of their own. On CUDA the block
    also resets and reads this rank's device peak (`Tracker.cuda_max_allocated`)."""
    comm = _comm.current()
    tracker = Tracker(comm.rank)
    device = _cuda_device(comm)
    if device is not None:
        torch.cuda.reset_peak_memory_stats(device)
    try:
        with attach((tracker,)):
            yield tracker
    finally:
        if device is not None:
            tracker.cuda_max_allocated = int(torch.cuda.max_memory_allocated(device))


def active_trackers() -> tuple:
    """The trackers of the `track` blocks around the calling thread (for `attach`)."""
    return tuple(_active.trackers)


@contextlib.contextmanager
def attach(trackers: Iterable[Tracker]) -> Iterator[None]:
    """Inside the block, tensors this thread saves for backward count in ``trackers`` too: for
    a thread that runs a rank's work for it (a runtime worker running a graph's forward), given
    `active_trackers` of the rank's thread. Nothing is installed when ``trackers`` is empty."""
    trackers = [t for t in trackers if t not in _active.trackers]
    if not trackers:
        yield
        return
    before = _active.trackers
    _active.trackers = list(before) + trackers
    try:
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            yield
    finally:
        _active.trackers = before


def _cuda_device(comm) -> torch.device | None:
    """This rank's CUDA device, when CUDA is usable (not tested on CPU-only machines)."""
    if not torch.cuda.is_available():
        return None
    try:
        return torch.device(comm.device("cuda"))
    except Exception:  # noqa: BLE001 - a rank without a CUDA device reports no CUDA peak
        return None
