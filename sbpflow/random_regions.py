"""Layout-independent random numbers: `generate_region` makes one region of a random logical
tensor without making the rest. The logical tensor, flattened row-major, is cut into blocks of
``BLOCK`` elements and block ``k`` is drawn from its own generator seeded by
``mix_seed(seed, k)``. Any region is therefore the same values whatever layout asks for it, and a
rank holds at most its region plus one block (`sf.randn`, `sf.nn.init`, dropout, sampling).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

__all__ = ["BLOCK", "mix_seed", "generate_region", "row_major_strides"]

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
