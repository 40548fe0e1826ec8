"""What each rank receives in the boxing planner's point-to-point transfer, as fractions of the
tensor: the analytic price's reduce-then-transfer reads these loads
(`redistribution_price._via_transfer`).

A search asks for thousands of them at a time (an edge table's entries), so they are found in
batches: one numpy pass over ``[layout pair, axis, rank]`` arrays for every pair of the same
rank count and number of axes (`find_fractions`), each then read from one memo
(`transfer_fraction`). Every float is the one a pass over one pair at a time gives (the same
elementwise operations, products over axes left to right).
"""

from __future__ import annotations

import itertools
import math
import threading
from collections import defaultdict

import numpy as np

from ..caches import BoundedDict, memoize
from .walk import PARTIAL_SUM, TRANSFER_MAX_RANKS, layout_code

__all__ = ["transfer_fraction", "find_fractions"]

# (fine, src, dst, ndim) -> the front: 1 << 20 entries, as the walks' memo (GPT-3's searches
# find about 100k; VGG-13's 20k)
_FRACTIONS = BoundedDict("auto.transfer_fractions", 1 << 20)


@memoize(1 << 10)
def _coord_rows(fine: tuple) -> np.ndarray:
    """Every coordinate of the mesh ``fine``, ranks row-major, as floats ``[dim, rank]``: one
    contiguous row per mesh dim."""
    coords = np.array(list(itertools.product(*[range(m) for m in fine])), dtype=np.float64)
    return np.ascontiguousarray(coords.T)


class _BoxTable:
    """The boxes of layouts on meshes of one rank count, for tensors of one number of axes:
    row ``i`` of ``lo`` and ``hi`` (``[row, axis, rank]``) is the fraction ``[lo, hi)`` of
    every tensor axis the rank at each mesh coordinate (row-major) holds under layout
    ``i`` (even splits), cut axis by axis in mesh-dim order. Per row, for a source: each
    axis's equal parts (the product of the mesh dims splitting it, ``parts``) and the
    overlap below which a box is not met (``tiny``); for a destination: the boxes' volumes
    (products over axes left to right, ``vol``) and which ranks receive (``receives``: a
    non-first rank of a ``P(sum)`` dim holds zeros). New layouts are cut in one numpy pass
    per batch (`rows`); a batch then gathers its pairs' rows, no per-pair arrays."""

    _FIELDS = ("lo", "hi", "parts", "tiny", "vol", "receives")

    def __init__(self, ranks: int, ndim: int) -> None:
        self.ranks, self.ndim = ranks, ndim
        self.index: dict = {}    # (fine, layout) -> row
        # the fields' arrays, with room to grow (doubling; rows past the index's unused)
        self.lo = self.hi = self.parts = self.tiny = self.vol = self.receives = None

    def rows(self, layouts: list) -> np.ndarray:
        """The rows of ``layouts`` (``(fine, layout)`` each), the new ones cut first."""
        new = [k for k in dict.fromkeys(layouts) if k not in self.index]
        if new:
            if len(self.index) + len(new) > _BOX_ROWS_KEPT:   # start afresh (the rows of
                self.__init__(self.ranks, self.ndim)          # this batch are all new)
                new = list(dict.fromkeys(layouts))
            self._append(self._cut(new))
            for k in new:
                self.index[k] = len(self.index)
        index = self.index
        return np.array([index[k] for k in layouts], dtype=np.int64)

    def _append(self, cut: dict) -> None:
        n, k = len(self.index), len(cut["lo"])
        if self.lo is None or n + k > len(self.lo):
            room = max(2 * n, n + k, 64)
            for f in _BoxTable._FIELDS:
                grown = np.empty((room,) + cut[f].shape[1:], dtype=cut[f].dtype)
                if n:
                    grown[:n] = getattr(self, f)[:n]
                setattr(self, f, grown)
        for f in _BoxTable._FIELDS:
            getattr(self, f)[n:n + k] = cut[f]

    def _cut(self, new: list) -> dict:
        n, ndim, dims = len(new), self.ndim, max(len(f) for f, _ in new)
        coords = np.zeros((n, dims, self.ranks))
        axis = np.full((n, dims), -1)               # the axis a mesh dim splits, or -1
        summed = np.zeros((n, dims), dtype=bool)    # a P(sum) mesh dim
        size = np.ones((n, dims))
        for i, (fine, nd) in enumerate(new):
            coords[i, :len(fine)] = _coord_rows(fine)
            size[i, :len(fine)] = fine
            for d, c in enumerate(layout_code(nd)):
                if c >= 0:
                    axis[i, d] = c
                elif c == PARTIAL_SUM:
                    summed[i, d] = True
        lo, hi = np.zeros((n, ndim, self.ranks)), np.ones((n, ndim, self.ranks))
        parts, receives = np.ones((n, ndim)), np.ones((n, self.ranks), dtype=bool)
        for d in range(dims):
            at = np.nonzero(axis[:, d] >= 0)[0]
            a = axis[at, d]
            # the same elementwise operations as cutting one layout at a time
            w = (hi[at, a] - lo[at, a]) / size[at, d, None]
            lo[at, a] += coords[at, d] * w
            hi[at, a] = lo[at, a] + w
            parts[at, a] *= size[at, d]
            receives[summed[:, d]] &= coords[summed[:, d], d] == 0
        widths = hi - lo
        vol = widths[:, 0]
        for a in range(1, ndim):
            vol = vol * widths[:, a]
        return {"lo": lo, "hi": hi, "parts": parts, "tiny": 1e-9 / parts, "vol": vol,
                "receives": receives}


# layouts a table keeps (GPT-3 exhaustive's transfers cut about 8k, VGG-13's 6k)
_BOX_ROWS_KEPT = 1 << 14
_BOX_TABLES = BoundedDict("auto.box_tables", 1 << 8)   # (ranks, ndim) -> _BoxTable
_BOX_LOCK = threading.Lock()   # a batch's rows found and gathered before another changes them


def _box_table(ranks: int, ndim: int) -> _BoxTable:
    table = _BOX_TABLES.get((ranks, ndim))
    if table is None:
        table = _BOX_TABLES.put((ranks, ndim), _BoxTable(ranks, ndim))
    return table


def transfer_fraction(fine: tuple, src: tuple, dst: tuple, ndim: int):
    """The receivers' loads when a partial-free ``src`` layout is sent point to point into
    ``dst`` on the mesh ``fine``: the ``(elements, messages)`` of every receiver not
    dominated by another, most elements first, elements as fractions of the tensor (rounded
    to 1e-12); ``()`` if nobody receives, None above ``TRANSFER_MAX_RANKS`` ranks. A rank
    receives the part of its destination box it does not hold, one message from each
    distinct source box it meets; a non-first rank of a ``P(sum)`` destination dim receives
    nothing (it holds zeros; a ``P(max)`` / ``P(min)`` one holds a copy, so it does)."""
    key = (fine, src, dst, ndim)
    hit = _FRACTIONS.get(key, _FRACTIONS)
    if hit is _FRACTIONS:
        # read what it found, not the memo: a concurrent search may empty the full memo
        found = find_fractions([key])
        hit = found[key] if key in found else _FRACTIONS[key]
    return hit


def find_fractions(keys) -> dict:
    """Find `transfer_fraction` of every ``(fine, src, dst, ndim)`` in ``keys`` not yet known,
    a batch per rank count and number of axes; those found, by key."""
    batches: dict = defaultdict(dict)
    found: dict = {}
    for key in keys:
        if key in _FRACTIONS:
            continue
        fine, _, _, ndim = key
        ranks = math.prod(fine)
        if ranks > TRANSFER_MAX_RANKS:
            found[key] = None
        elif ndim == 0:   # a scalar: every rank holds it whole
            found[key] = ()
        else:
            batches[(ranks, ndim)][key] = None
    for (_, ndim), batch in batches.items():
        batch = list(batch)
        found.update(zip(batch, _fronts(batch, ndim)))
    for key, front in found.items():
        _FRACTIONS.put(key, front)
    return found


def _fronts(keys: list, ndim: int) -> list:
    """The fronts of ``keys`` (each on a mesh of the same number of ranks, tensors of ``ndim``
    axes). The distinct source boxes tile the tensor as a grid (each axis cut in as many
    equal parts as the mesh dims splitting it make), so for a receiver whose destination box
    is ``want`` and own source box ``have``, the elements it lacks are ``|want| - |want ∩
    have|`` and its messages the grid cells ``want`` meets, less its own if ``want`` meets
    it; both factor over axes. Arrays ``[pair, axis, rank]``, an axis at a time."""
    layouts = [(f, s) for f, s, _, _ in keys] + [(f, d) for f, _, d, _ in keys]
    with _BOX_LOCK:   # concurrent searches (rank threads) share the tables
        table = _box_table(math.prod(keys[0][0]), ndim)
        rows = table.rows(layouts)
        sr, dr = rows[:len(keys)], rows[len(keys):]
        slo, shi, parts, tiny = table.lo[sr], table.hi[sr], table.parts[sr, :, None], \
            table.tiny[sr, :, None]
        dlo, dhi, dvol, receives = table.lo[dr], table.hi[dr], table.vol[dr], table.receives[dr]
    # per pair, axis and rank: how much of the destination interval the source one covers,
    # and how many source cells the destination interval meets (whole numbers)
    inter = np.minimum(dhi, shi)
    inter -= np.maximum(dlo, slo)
    np.maximum(inter, 0.0, out=inter)
    cells = np.maximum(np.ceil(dhi * parts - 1e-9) - np.floor(dlo * parts + 1e-9), 0.0)
    met = inter > tiny
    held, meets, grid = inter[:, 0], met[:, 0], cells[:, 0]
    for a in range(1, ndim):
        held = held * inter[:, a]
        meets = meets & met[:, a]
        grid = grid * cells[:, a]
    elems = dvol - held
    msgs = grid - meets
    need = receives & (elems > 1e-12)
    # the usual case: the first rank with the most elements has the most messages too; it
    # dominates every other, and the front is its pair
    k = np.where(need, elems, -np.inf).argmax(axis=1)
    busiest = np.where(need, msgs, -np.inf).max(axis=1)
    at = np.arange(len(keys))
    ek, lone = elems[at, k].tolist(), (msgs[at, k] == busiest).tolist()
    busiest, anyone = busiest.tolist(), need.any(axis=1).tolist()
    out = []
    for i in range(len(keys)):
        if not anyone[i]:
            out.append(())
        elif lone[i]:
            out.append(((round(ek[i], 12), int(round(busiest[i]))),))
        else:
            out.append(_front(elems[i][need[i]], msgs[i][need[i]]))
    return out


def _front(elems: np.ndarray, msgs: np.ndarray) -> tuple:
    """The Pareto front of the receivers' ``(elements, messages)``, elements compared to
    rounding (rounded once per distinct pair: ranks share a few loads), most elements
    first."""
    pairs = set(zip(elems.tolist(), msgs.tolist()))
    loads = sorted({(round(e, 12), int(round(m))) for e, m in pairs})
    front: list = []
    for e, m in reversed(loads):
        if not front or m > front[-1][1]:
            front.append((e, m))
    return tuple(front)
