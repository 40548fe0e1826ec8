"""Small helpers with no sbpflow dependencies: `IdentityMap`, a weak map keyed by identity
(per-parameter registries); `text_digest`; rebuilding a sequence of the same kind; `renamed`, a
module ``__getattr__`` that keeps a renamed name working for one release; `generated_function`,
a function compiled from generated source that tracebacks can show.
(Layout-independent random numbers are `sbpflow.random_regions`.)
"""

from __future__ import annotations

import hashlib
import itertools
import linecache
import sys
import warnings
import weakref
from typing import Any, Callable, Iterator


__all__ = ["IdentityMap", "text_digest", "sequence_of", "rebuild_sequence", "renamed",
           "generated_function"]

_generated = itertools.count()  # one file name a generated function


class IdentityMap:
    """A map keyed by object identity whose entries go with their key (held by a weak
    reference). A lookup never compares keys with ``==``: a ``weakref.WeakKeyDictionary``
    does (its references compare their referents), and for a `GlobalTensor` that is an op, a
    few us a lookup. For the registries kept per parameter (its update layout, its boxed
    gradient, which sync owns it)."""

    __slots__ = ("_d", "__weakref__")

    def __init__(self) -> None:
        self._d: dict = {}   # id(key) -> (weak reference to key, value)

    def __setitem__(self, key: Any, value: Any) -> None:
        def gone(ref, k=id(key), d=self._d) -> None:
            hit = d.get(k)
            if hit is not None and hit[0] is ref:   # (not a newer key of a reused id)
                del d[k]
        self._d[id(key)] = (weakref.ref(key, gone), value)

    def _hit(self, key: Any):
        hit = self._d.get(id(key))
        return hit if hit is not None and hit[0]() is key else None

    def get(self, key: Any, default: Any = None) -> Any:
        hit = self._hit(key)
        return default if hit is None else hit[1]

    def __getitem__(self, key: Any) -> Any:
        hit = self._hit(key)
        if hit is None:
            raise KeyError(f"<{type(key).__name__} at {id(key):#x}>")
        return hit[1]

    def __contains__(self, key: Any) -> bool:
        return self._hit(key) is not None

    def pop(self, key: Any, *default: Any) -> Any:
        hit = self._hit(key)
        if hit is not None:
            del self._d[id(key)]
            return hit[1]
        if default:
            return default[0]
        raise KeyError(f"<{type(key).__name__} at {id(key):#x}>")

    def __delitem__(self, key: Any) -> None:
        self.pop(key)

    def items(self) -> list:
        """(key, value) of the live keys (a list: safe while the map changes)."""
        out = []
        for ref, value in list(self._d.values()):
            key = ref()
            if key is not None:
                out.append((key, value))
        return out

    def __iter__(self) -> Iterator:
        return iter([k for k, _ in self.items()])

    def values(self) -> list:
        return [v for _, v in self.items()]

    def update(self, other: Any) -> None:
        for key, value in (other.items() if hasattr(other, "items") else other):
            self[key] = value

    def clear(self) -> None:
        self._d.clear()

    def __len__(self) -> int:
        return len(self._d)

    def __bool__(self) -> bool:
        return bool(self._d)


def text_digest(text: str) -> int:
    """A 63-bit digest of ``text`` (an int64 the ranks compare to check they agree)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def sequence_of(kind: type, items: Any) -> Any:
    """A ``kind`` (tuple, list or a namedtuple class) holding ``items`` (a namedtuple takes its
    fields as arguments, where ``tuple`` and ``list`` take one iterable)."""
    return kind(*items) if hasattr(kind, "_fields") else kind(items)


def rebuild_sequence(value: Any, items: Any) -> Any:
    """A tuple / list of ``value``'s type holding ``items`` (`sequence_of`)."""
    return sequence_of(type(value), items)


def renamed(module: str, old_to_new: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for names that moved: ``old_to_new`` maps an old name to
    ``"new"`` (in ``module``), ``"package.module:new"`` or ``"package.module:"`` (the module
    itself). The old name gives the new one's value for one release, with a DeprecationWarning
    (which Python shows once per place that reads it)."""

    def __getattr__(name: str) -> Any:
        if name not in old_to_new:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        where, _, new = old_to_new[name].rpartition(":")
        warnings.warn(f"{module}.{name} was renamed {where or module}{'.' * bool(new)}{new}",
                      DeprecationWarning, stacklevel=2)
        if where:
            __import__(where)
        home = sys.modules[where or module]
        return getattr(home, new) if new else home
    return __getattr__


__getattr__ = renamed(__name__, {name: f"sbpflow.random_regions:{name}" for name in
                                 ("BLOCK", "mix_seed", "generate_region", "row_major_strides")})


def generated_function(src: str, label: str, ns: dict, fn: str = "run") -> Callable:
    """Function ``fn`` of the module source ``src`` (generated code), run in namespace
    ``ns``; its file is named after ``label``, and its source stays in `linecache` while the
    function lives, so that tracebacks show the generated lines (a plan rebuilt often makes
    many such functions: none is kept after it goes). ``.source`` holds ``src``."""
    name = f"<sbpflow {label} {next(_generated)}>"
    exec(compile(src, name, "exec"), ns)
    out = ns[fn]
    linecache.cache[name] = (len(src), None, src.splitlines(True), name)
    weakref.finalize(out, linecache.cache.pop, name, None)
    out.source = src
    return out
