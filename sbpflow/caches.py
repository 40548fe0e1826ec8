"""Every memo table of sbpflow, registered by name with a bound.

Caches hold only values that can be recomputed from their keys, so clearing one costs misses,
never a wrong answer. `clear_caches` empties them all (after registering new ops, say, or to
measure cold-start costs); `cache_info` shows each one's size and bound.

Two kinds: `memoize` (``functools.lru_cache`` with a bound) for pure functions, and
`BoundedDict` for hot paths that want a plain ``dict.get`` in C; it empties itself when full.
`collector_paused` keeps CPython's cyclic collector from re-scanning them while they fill.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import threading
from typing import Any, Callable, Hashable, Iterator, NamedTuple

__all__ = ["memoize", "BoundedDict", "clear_caches", "cache_info", "CacheInfo",
           "collector_paused"]


class CacheInfo(NamedTuple):
    size: int
    maxsize: int


class _Registered(NamedTuple):
    clear: Callable[[], None]
    size: Callable[[], int]
    maxsize: int


_REGISTRY: dict[str, _Registered] = {}


def _register(name: str, clear: Callable[[], None], size: Callable[[], int], maxsize: int) -> None:
    """Register a cache; a later registration of the same name (a reloaded module) replaces
    the earlier one."""
    _REGISTRY[name] = _Registered(clear, size, maxsize)


def memoize(maxsize: int = 1 << 14, name: str | None = None) -> Callable[[Callable], Callable]:
    """``functools.lru_cache(maxsize)`` registered as ``name`` (default: the function's module
    and qualified name). Use it on module-level pure functions of hashable arguments."""
    if not isinstance(maxsize, int) or maxsize < 1:
        raise ValueError(f"memoize: maxsize must be a positive int, got {maxsize!r}")

    def decorate(fn: Callable) -> Callable:
        cached = functools.lru_cache(maxsize=maxsize)(fn)
        _register(name or f"{fn.__module__}.{fn.__qualname__}", cached.cache_clear,
                  lambda: cached.cache_info().currsize, maxsize)
        return cached
    return decorate


class BoundedDict(dict):
    """A registered memo dict: read it with ``get`` (dict's, in C), fill it with `put`, which
    empties the dict first when it holds ``maxsize`` entries (the hot path pays no LRU
    bookkeeping; after a clear the working set refills in one pass)."""

    __slots__ = ("maxsize",)

    def __init__(self, name: str, maxsize: int = 1 << 16) -> None:
        super().__init__()
        self.maxsize = maxsize
        _register(name, self.clear, self.__len__, maxsize)

    def put(self, key: Hashable, value: Any) -> Any:
        """Store ``value`` under ``key`` and return it."""
        if len(self) >= self.maxsize:
            self.clear()
        self[key] = value
        return value

    def setdefault(self, key: Hashable, default: Any = None) -> Any:
        """``dict.setdefault`` within the bound: the value stored first wins (atomic under the
        GIL, so threads that race agree on it)."""
        if len(self) >= self.maxsize:
            self.clear()
        return dict.setdefault(self, key, default)


def clear_caches() -> None:
    """Empty every sbpflow cache (safe at any time between ops; results do not change)."""
    for entry in _REGISTRY.values():
        entry.clear()


def cache_info() -> dict[str, CacheInfo]:
    """Each registered cache's current size and bound, by name."""
    return {name: CacheInfo(e.size(), e.maxsize) for name, e in _REGISTRY.items()}


_PAUSE = {"depth": 0, "was_enabled": False}
_PAUSE_LOCK = threading.Lock()


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Pause CPython's cyclic garbage collector inside the block, restoring its state after.

    A strategy search fills these memos with millions of small tuples, and each of the
    collector's full passes walks every one of them again: 11-13 % of a default search
    (GPT-3 exhaustive, VGG-13). Memo entries hold no reference cycles, so nothing is lost:
    reference counting frees what the block drops, and whatever cyclic garbage it leaves is
    collected as usual once the block ends. Nested and concurrent blocks share one pause
    (the collector is the process's); the outermost block restores it."""
    with _PAUSE_LOCK:
        if _PAUSE["depth"] == 0:
            _PAUSE["was_enabled"] = gc.isenabled()
            gc.disable()
        _PAUSE["depth"] += 1
    try:
        yield
    finally:
        with _PAUSE_LOCK:
            _PAUSE["depth"] -= 1
            if _PAUSE["depth"] == 0 and _PAUSE["was_enabled"]:
                gc.enable()
