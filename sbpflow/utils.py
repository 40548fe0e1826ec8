"""Small helpers with no sbpflow dependencies.

`generate_region` makes one region of a random logical tensor without making the rest: the
logical tensor, flattened row-major, is cut into blocks of ``BLOCK`` elements and block ``k`` is
drawn from its own generator seeded by ``(seed, k)``. Any region is therefore the same values
whatever layout asks for it, and a rank holds at most its region plus one block.
`IdentityMap` is a weak map keyed by identity (per-parameter registries).
"""

from __future__ import annotations

import hashlib
import math
import weakref
from typing import Any, Iterator, Sequence

import torch

__all__ = ["BLOCK", "mix_seed", "generate_region", "row_major_strides", "IdentityMap",
           "text_digest", "sequence_of", "rebuild_sequence"]

BLOCK = 1 << 16
_MASK = (1 << 63) - 1


def mix_seed(seed: int, k: int) -> int:
    """A well-spread 63-bit seed for block ``k`` of a tensor seeded ``seed`` (splitmix64 step)."""
    z = (seed * 0x9E3779B97F4A7C15 + (k + 1) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (z ^ (z >> 31)) & _MASK


def row_major_strides(shape: Sequence[int]) -> list[int]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= int(n)
    return list(reversed(strides))


def _draw(kind: str, n: int, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    # Low-precision floats are drawn in float32 then rounded, so all layouts agree bit for bit.
    draw_dtype = dtype if dtype in (torch.float32, torch.float64) else torch.float32
    if kind == "randn":
        return torch.randn(n, generator=gen, dtype=draw_dtype).to(dtype)
    if kind == "rand":
        return torch.rand(n, generator=gen, dtype=draw_dtype).to(dtype)
    raise ValueError(f"unknown random kind {kind!r}")


def generate_region(kind: str, shape: Sequence[int], box: Sequence[tuple[int, int]], seed: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """Region ``box`` (``(start, size)`` per axis) of the random tensor ``kind(shape, seed)``."""
    region = tuple(size for _, size in box)
    numel = math.prod(region)
    if numel == 0:
        return torch.empty(region, dtype=dtype)
    total = math.prod(shape)
    flat = torch.zeros((), dtype=torch.int64)
    for (start, size), stride in zip(box, row_major_strides(shape)):
        flat = flat.unsqueeze(-1) + torch.arange(start, start + size, dtype=torch.int64) * stride
    flat = flat.reshape(-1)  # ascending: a box enumerated row-major
    out = torch.empty(numel, dtype=dtype)
    gen = torch.Generator()
    first, last = int(flat[0]) // BLOCK, int(flat[-1]) // BLOCK
    bounds = torch.searchsorted(flat, torch.arange(first, last + 2, dtype=torch.int64) * BLOCK)
    for i, k in enumerate(range(first, last + 1)):
        lo, hi = int(bounds[i]), int(bounds[i + 1])
        if lo == hi:
            continue
        gen.manual_seed(mix_seed(seed, k))
        values = _draw(kind, min(BLOCK, total - k * BLOCK), gen, dtype)
        out[lo:hi] = values[flat[lo:hi] - k * BLOCK]
    return out.reshape(region)


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
