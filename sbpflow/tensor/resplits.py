"""Costly re-splits: the nn layer watches a fused projection's output (sf.nn.torch_layouts),
and is called back with the axis when `split` / `chunk` cuts it (`watch_resplit`), once; the
tensor's ``split`` and ``chunk`` (tensor/methods.py) consult the table while it is not empty.
"""

from __future__ import annotations

import weakref

__all__ = ["watch_resplit"]


# -- costly re-splits (sf.nn.torch_layouts: a fused projection's output cut along its split) ---
# id(tensor) -> (weakref to it, callback(tensor, dim)); consulted by split / chunk while not empty
_RESPLITS: dict = {}


def watch_resplit(t: "GlobalTensor", callback) -> None:
    """Call ``callback(t, dim)`` if ``t`` is cut by ``split`` / ``chunk`` (once)."""
    _RESPLITS[id(t)] = (weakref.ref(t), callback)


def _watch_resplit(t: "GlobalTensor", dim: int) -> None:
    entry = _RESPLITS.pop(id(t), None)
    if entry is not None and entry[0]() is t:
        entry[1](t, dim)
