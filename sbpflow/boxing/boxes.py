"""Boxes: axis-aligned regions of a logical tensor, as ``((start, size), ...)`` per axis.

Every shard is a box (see `sbpflow.sbp.shard_box`); boxing moves the intersections of boxes.
"""

from __future__ import annotations

import math
from typing import Sequence

from ..sbp import Box

__all__ = ["Box", "box_shape", "box_numel", "intersect", "relative", "contains", "full_box",
           "tiles"]


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(size for _, size in box)


def box_numel(box: Box) -> int:
    return math.prod(size for _, size in box)


def intersect(a: Box, b: Box) -> Box:
    """The common region of two boxes (sizes may be 0)."""
    out = []
    for (s1, n1), (s2, n2) in zip(a, b):
        lo, hi = max(s1, s2), min(s1 + n1, s2 + n2)
        out.append((lo, max(hi - lo, 0)))
    return tuple(out)


def relative(box: Box, origin: Box) -> tuple[slice, ...]:
    """Slices that select ``box`` inside a tensor holding region ``origin``."""
    return tuple(slice(s - o, s - o + n) for (s, n), (o, _) in zip(box, origin))


def contains(outer: Box, inner: Box) -> bool:
    """Whether region ``inner`` lies inside ``outer`` (geometrically, also when empty)."""
    return all(o <= s and s + n <= o + m for (s, n), (o, m) in zip(inner, outer))


def full_box(shape: Sequence[int]) -> Box:
    return tuple((0, int(n)) for n in shape)


def tiles(boxes: Sequence[Box], region: Box) -> bool:
    """Whether ``boxes`` cover ``region`` exactly once: each inside it, pairwise disjoint, and
    together as large as it."""
    if not all(contains(region, b) for b in boxes):
        return False
    if sum(box_numel(b) for b in boxes) != box_numel(region):
        return False
    return all(box_numel(intersect(a, b)) == 0
               for i, a in enumerate(boxes) for b in boxes[i + 1:])
