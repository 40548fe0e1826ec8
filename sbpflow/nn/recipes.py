"""The initialisation recipes of meta tensors (`sf.nn.init.meta_init`): the in-place steps
that give a storage-less tensor its values (fills, zeroed rows, in order), which
`init.materialize` replays. Kept apart from `init` so that `Parameter` (which `init` builds)
can pass a recipe on to its copy without importing `init`.
"""

from __future__ import annotations

import threading
import weakref
from typing import Callable

from ..tensor import GlobalTensor

__all__ = ["record", "copy_record"]

# id(tensor) -> (a weak reference to it, the in-place steps that give it its values: fills,
# zeroed rows, in order). Keyed by id (global tensors may grow an elementwise __eq__) and checked
# by identity, so a recipe never passes to a new object that reuses a dead tensor's id; dropped
# when the tensor is collected. State, not a cache: sf.clear_caches() leaves it alone.
_RECIPES: dict[int, tuple[weakref.ref, list]] = {}
# rank threads build concurrently; reentrant, since a collected tensor's finalizer (_forget)
# may run on a thread that already holds it (garbage collection inside record())
_RECIPES_LOCK = threading.RLock()


def record(tensor: GlobalTensor, step: Callable[[GlobalTensor], object]) -> None:
    """Append ``step`` (an in-place function of a materialised tensor of the same logical
    shape) to the recipe of the meta ``tensor``; `materialize` replays the recipe in order."""
    with _RECIPES_LOCK:
        steps = _recipe(tensor)
        if steps is None:
            steps = []
            _RECIPES[id(tensor)] = (weakref.ref(tensor), steps)
            weakref.finalize(tensor, _forget, id(tensor))
        steps.append(step)


def _recipe(tensor: GlobalTensor) -> list | None:
    """The recorded steps of ``tensor`` (the caller holds the lock)."""
    entry = _RECIPES.get(id(tensor))
    return entry[1] if entry is not None and entry[0]() is tensor else None


def _forget(key: int) -> None:
    with _RECIPES_LOCK:
        entry = _RECIPES.get(key)
        if entry is not None and entry[0]() is None:  # not a newer tensor's, with the same id
            del _RECIPES[key]


def copy_record(src: GlobalTensor, dst: GlobalTensor) -> None:
    """Give ``dst`` (e.g. ``src`` cast to another dtype) the recipe of ``src``."""
    with _RECIPES_LOCK:
        steps = list(_recipe(src) or ())
    for step in steps:
        record(dst, step)
