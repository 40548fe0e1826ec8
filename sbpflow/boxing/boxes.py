"""Boxes: axis-aligned regions of a logical tensor, as ``((start, size), ...)`` per axis.

Every shard is a box (see `sbpflow.sbp.shard_box`); boxing moves the intersections of boxes.
"""

from __future__ import annotations

import math
from typing import Sequence

from ..sbp import Box

__all__ = ["Box", "box_shape", "box_numel", "intersect", "relative", "contains", "full_box",
           "tiles", "joins", "stacked_axis"]


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


def _flat_range(box: Box, outer: Box) -> tuple[int, int] | None:
    """The C-order element range ``box`` fills in a tensor holding ``outer`` when it is one
    run of consecutive elements (extent 1 on the axes before some axis, all of ``outer`` on
    the axes after it), else None. ``box`` lies inside ``outer`` and is not empty."""
    k = next((d for d in range(len(box) - 1, -1, -1) if box[d][1] != outer[d][1]), 0)
    if any(box[d][1] != 1 for d in range(k)):
        return None
    start, stride = 0, 1
    for (s, _), (o, m) in zip(reversed(box), reversed(outer)):
        start += (s - o) * stride
        stride *= m
    return start, start + box_numel(box)


def joins(boxes: Sequence[Box], region: Box) -> bool:
    """Whether ``boxes``, laid back to back in their order (each in C order), are ``region``
    in C order: the non-empty ones are consecutive runs of its elements, in order, covering
    it. Then pieces received into one buffer in that order already are the region's tensor."""
    at = 0
    for b in boxes:
        if box_numel(b) == 0:
            continue
        if not contains(region, b):
            return False
        run = _flat_range(b, region)
        if run is None or run[0] != at:
            return False
        at = run[1]
    return at == box_numel(region)


def stacked_axis(boxes: Sequence[Box], region: Box) -> int | None:
    """The axis along which ``boxes``, in their order, are consecutive slabs of ``region``
    (each all of it on the other axes; empty ones skipped) covering it: their tensors'
    ``torch.cat`` on that axis is the region's tensor. None when there is no such axis."""
    full = [b for b in boxes if box_numel(b) > 0]
    if not full:
        return None
    for axis in range(len(region)):
        at, end = region[axis][0], region[axis][0] + region[axis][1]
        ok = True
        for b in full:
            if any(b[d] != region[d] for d in range(len(region)) if d != axis) or \
                    b[axis][0] != at:
                ok = False
                break
            at += b[axis][1]
        if ok and at == end:
            return axis
    return None
