"""The shape-free walk of the analytic redistribution (`redistribution_price.find_walk`): from
one layout to another on a refined mesh, the fixed order's moves, or, where a move of that
order is not a valid boxing step (nested splits of one axis), the planner's reduce-then-
transfer options.

A search walks tens of thousands of distinct layout pairs, so the walk runs on layouts coded
as small ints (`layout_code`: ``S(a)`` is ``a``, ``B`` is -1, ``P(op)`` is -2, -3, -4),
where a kind test is one comparison. Its records hold sbp layouts again (`WalkMove`,
`TransferOption`), the same values the walk on sbps gave. The step-validity test on codes,
`_valid`, is `sbpflow.boxing.steps.is_valid_move`'s rule; a test checks them equal on every
move of small meshes.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from ..sbp import B, Broadcast, Partial, S, Split

__all__ = ["TRANSFER_MAX_RANKS", "PARTIAL_SUM", "Walk", "WalkMove", "TransferOption",
           "TransferWalk", "fine_walk", "layout_code", "divisor"]

# meshes of more ranks than this are not enumerated (too many boxes for a search): a move the
# fixed order cannot make is priced as its collective instead of the planner's transfer
TRANSFER_MAX_RANKS = 256

_B = -1                                           # code of B; partials are <= -2
PARTIAL_SUM = -2                                  # code of P(sum)
_PARTIAL_CODES = {"sum": PARTIAL_SUM, "max": -3, "min": -4}
_PARTIALS = {-2: Partial("sum"), -3: Partial("max"), -4: Partial("min")}
_SPLITS = tuple(S(a) for a in range(16))   # shared values: later equality tests are identity


class WalkMove(NamedTuple):
    """A move before the tensor's shape is known: its piece is ``numel / div`` (``div`` 0:
    the whole ``numel``; None: no piece, a local move), its strided copies ``copy`` terms
    ``(layout, axes, g)``: ``piece / g`` (``g`` None: ``piece``) when a rank's local shard
    under ``layout`` is strided along one of ``axes`` (`redistribution_price._strided`)."""

    kind: str
    mesh: tuple
    dims: tuple
    div: int | None
    copy: tuple = ()
    fallback: str = ""


class TransferOption(NamedTuple):
    """One of the planner's reduce-then-transfer options (`_transfer_options`)."""

    pre: tuple | None   # the reduction ``(kind, dims, div, axis)``; None without partial dims
    mid: tuple          # the reduced layout the transfer starts from
    lack: float         # rank 0's load of the transfer (`lack_of`)


class TransferWalk(NamedTuple):
    """The reduce-then-transfer walk from ``src`` to ``dst`` on ``fine`` (tensors of ``ndim``
    axes): its ``options``; per reduction kind (None: no reduction) the least rank-0 load of
    its options, ``(kind, dims, div, group size, lack)`` in ``least`` (a floor's terms: the
    options of one kind reduce the same piece); the `transfer_fraction` keys of its options'
    loads, ``keys``."""

    fine: tuple
    src: tuple
    dst: tuple
    ndim: int
    options: tuple
    least: tuple
    keys: tuple


class Walk:
    """A redistribution's shape-free walk: ``how`` is ``"moves"`` (``body``: its `WalkMove` s)
    or ``"transfer"`` (``body``: a `TransferWalk`); unpacks as ``how, body``. Compared and hashed
    by identity: the evaluator keeps prices by walk and shape (layout pairs that refine to one
    walk share them), and an equal walk held by another object is only a memo miss."""

    __slots__ = ("how", "body")

    def __init__(self, how: str, body) -> None:
        self.how, self.body = how, body

    def __iter__(self):
        return iter((self.how, self.body))

    def __repr__(self) -> str:
        return f"Walk({self.how!r}, {self.body!r})"


def layout_code(nd) -> list:
    """``nd``'s sbps as ints: ``S(a)`` -> ``a``, ``B`` -> -1, ``P(sum|max|min)`` -> -2|-3|-4."""
    out = []
    for x in nd:
        t = type(x)
        out.append(x.axis if t is Split else _B if t is Broadcast else _PARTIAL_CODES[x.op])
    return out


def _layout(codes) -> tuple:
    """The sbp layout of ``codes`` (`layout_code`'s inverse)."""
    return tuple(_split(c) if c >= 0 else B if c == _B else _PARTIALS[c] for c in codes)


def _split(a: int) -> Split:
    return _SPLITS[a] if a < len(_SPLITS) else S(a)


def divisor(fine: tuple, codes, skip) -> int:
    """The product of the mesh dims outside ``skip`` that split an axis (what a piece of the
    tensor is divided by)."""
    out = 1
    for j, c in enumerate(codes):
        if c >= 0 and j not in skip:
            out *= fine[j]
    return out


def _valid(src, dst, dims) -> bool:
    """`sbpflow.boxing.steps.is_valid_move` on codes: no mesh dim outside ``dims`` after
    ``min(dims)`` splits an axis the move touches."""
    touched = set()
    for j in dims:
        a, b = src[j], dst[j]
        if a >= 0:
            touched.add(a)
        if b >= 0:
            touched.add(b)
    for e in range(min(dims) + 1, len(src)):
        x = src[e]
        if x >= 0 and x in touched and e not in dims:
            return False
    return True


def _reduced_first(s: list, d: list, ndim: int) -> list:
    """``d`` with every dim where two different partials meet (no local step turns one into
    the other: `sbpflow.boxing.steps.is_local_change`) made a split of an axis no dim splits
    (else axis 0): such a dim is reduce-scattered first, as the planner does, and the split
    turns partial locally at the end."""
    for a, b in zip(s, d):
        if a <= -2 and b <= -2 and a != b:
            break
    else:
        return list(d)   # the common case: no two different partials meet
    used = {x for x in s + d if x >= 0}
    free = [a for a in range(ndim) if a not in used]
    out = list(d)
    for j, (a, b) in enumerate(zip(s, d)):
        if a <= -2 and b <= -2 and a != b:
            out[j] = free.pop(0) if free else 0
    return out


def fine_walk(ndim: int, fine: tuple, s: tuple, d: tuple) -> Walk:
    """The walk from layout ``s`` to ``d`` on the mesh ``fine`` (both layouts on it), for
    tensors of ``ndim`` axes: the fixed order's moves (nested slices, local slices,
    reduce-scatters, all-to-alls, all-reduces, all-gathers, the last local steps), or, at
    the first of them that is not a valid step, the planner's reduce-then-transfer
    (`_transfer_options`); above ``TRANSFER_MAX_RANKS`` ranks such a move is priced as the
    collective the fixed order would use."""
    sc, dc = layout_code(s), layout_code(d)
    enumerable = math.prod(fine) <= TRANSFER_MAX_RANKS
    moves = _FixedOrder(ndim, fine, list(sc), dc, stop_at_nested=enumerable).run()
    if moves is None:   # the walk is dropped: the planner's reduce-then-transfer instead
        return Walk("transfer", _transfer_options(ndim, fine, s, d, sc, dc))
    if not any(m.kind == "nested" for m in moves):
        return Walk("moves", moves)
    return Walk("moves", tuple(m if m.kind != "nested" else
                               WalkMove(m.fallback, m.mesh, m.dims, m.div) for m in moves))


class _FixedOrder:
    """The fixed order's walk (`fine_walk`): ``state`` is the layout so far (codes),
    ``target`` what the phases move it to, ``moves`` the records (a move that is not a
    valid step is a ``"nested"`` one, or with ``stop_at_nested`` ends the walk: `run` gives
    None)."""

    def __init__(self, ndim: int, fine: tuple, s: list, d: list, stop_at_nested: bool) -> None:
        self.fine = fine
        self.stop_at_nested = stop_at_nested
        self.stopped = False
        self.final = d
        self.target = _reduced_first(s, d, ndim)  # until the last local phase
        self.state = s
        self.moves: list[WalkMove] = []
        # a move can only be invalid if some tensor axis is split on two different dims (in
        # the source or the destination): otherwise skip the checks (the common, fast case)
        first_dim: dict = {}
        n, nested = len(fine), False
        for j, x in enumerate(s + self.target):
            if x >= 0 and first_dim.setdefault(x, j % n) != j % n:
                nested = True
                break
        self.nested = nested

    def run(self) -> tuple | None:
        self.nested_slices()
        # a phase moves its dims to their targets and no other dim, so which phase a dim
        # belongs to is read off the state once
        local, scatter, a2a, reduce = [], [], [], []
        for j, (a, b) in enumerate(zip(self.state, self.target)):
            if a == b:
                continue
            if a == _B:
                local.append(j)
            elif a <= -2:
                if b >= 0:
                    scatter.append(j)
                elif b == _B:
                    reduce.append(j)
            elif b >= 0:
                a2a.append(j)
        self.phase(None, tuple(local))
        self.phase("reduce_scatter", tuple(scatter))
        self.phase("all_to_all", tuple(a2a))
        self.phase("all_reduce", tuple(reduce))
        if self.stopped:   # the usual end of a nested walk: the rest is not needed
            return None
        self.all_gather()
        st = self.state
        self.target = self.final
        self.phase(None, tuple(j for j, (a, b) in enumerate(zip(st, self.final)) if a != b))
        return None if self.stopped else tuple(self.moves)  # the last phase: S -> P, local

    def nested_move(self, dims: tuple, piece: int, fallback: str) -> None:
        if self.stop_at_nested:
            self.stopped = True   # the phases after this one do nothing
            return
        self.moves.append(WalkMove("nested", self.fine, dims, piece, fallback=fallback))

    def moved(self, dims) -> list:
        """``state`` with ``dims`` at their target."""
        new = list(self.state)
        for j in dims:
            new[j] = self.target[j]
        return new

    def nested_slices(self) -> None:
        """B -> S is a local slice, unless a later dim splits the same axis: then the slice a
        rank needs is mostly held by others (priced as an all-to-all over those dims:
        estimate)."""
        state, target, n = self.state, self.target, len(self.fine)

        def later_split(j, axis):
            return tuple(k for k in range(j + 1, n) if state[k] == axis)
        moved = set()
        for j in range(n):
            if state[j] == _B and target[j] >= 0 and later_split(j, target[j]) and \
                    j not in moved:
                dims = (j,) + tuple(k for k in later_split(j, target[j]) if k not in moved)
                self.nested_move(dims, divisor(self.fine, state, dims), "all_to_all")
                moved.update(dims)
        for j in moved:
            if state[j] == _B:
                state[j] = target[j]

    def phase(self, kind: str | None, dims: tuple) -> None:
        """Move ``dims`` to their target at once: a ``kind`` collective over their joint group
        (None: a local step)."""
        if not dims or self.stopped:
            return
        new = self.moved(dims)
        if self.nested and not _valid(self.state, new, dims):
            # the collective the move would be (a local slice whose part is held by others:
            # an all-to-all) is the price of last resort
            self.nested_move(dims, divisor(self.fine, self.state, dims), kind or "all_to_all")
        elif kind is None:
            self.moves.append(WalkMove("local", self.fine, dims, None))
        else:
            self.moves.append(WalkMove(kind, self.fine, dims, divisor(self.fine, self.state, dims),
                                       self.copies(kind, dims, new)))
        self.state = new

    def copies(self, kind: str, dims: tuple, new: list) -> tuple:
        """Strided-copy terms of a reduce-scatter / all-to-all (`WalkMove`)."""
        if kind not in ("reduce_scatter", "all_to_all"):
            return ()
        g = math.prod(self.fine[j] for j in dims)
        # the pieces are cut along the destination split of the local input
        terms = [(_layout(self.state), tuple(self.target[j] for j in dims),
                  None if kind == "reduce_scatter" else g)]
        if kind == "all_to_all":
            # received pieces are written along the source split of the local output
            terms.append((_layout(new), tuple(self.state[j] for j in dims), g))
        return tuple(terms)

    def all_gather(self) -> None:
        """An all-gather is about the gathered piece: the other dims already in their final
        state."""
        state, target = self.state, self.target
        dims = tuple(j for j in range(len(self.fine)) if state[j] >= 0 and target[j] == _B)
        if not dims or self.stopped:
            return
        new = self.moved(dims)
        valid = not self.nested or _valid(state, new, dims)
        # the gathered pieces are written along the source split axes of the local output
        terms = ((_layout(new), tuple(state[j] for j in dims), None),)
        self.state = new
        piece = divisor(self.fine, new, dims)
        if valid:
            self.moves.append(WalkMove("all_gather", self.fine, dims, piece, terms))
        else:
            self.nested_move(dims, piece, "all_gather")


def _own_box(fine: tuple, codes, ndim: int) -> list:
    """Rank 0's box under the layout ``codes``: per axis the ``x`` of its ``[0, x)`` (the
    floats the box tables of `transfer_loads` cut for rank 0)."""
    own = [1.0] * ndim
    for c, m in zip(codes, fine):
        if c >= 0:
            own[c] = own[c] / m
    return own


def _transfer_options(ndim: int, fine: tuple, s: tuple, d: tuple, sc: list,
                      dc: list) -> TransferWalk:
    """The planner's reduce-then-transfer from ``s`` to ``d`` on the refined mesh ``fine`` (of
    at most ``TRANSFER_MAX_RANKS`` ranks), shape-free: a `TransferOption` per reduced layout
    it may start from (broadcast, or a split of some axis, where that reduce-scatter is a
    valid step); ``sc``, ``dc``: the layouts' codes. The receivers' loads
    (`transfer_fraction`) are found when a price needs them."""
    own_d = _own_box(fine, dc, ndim)
    own_s = _own_box(fine, sc, ndim)
    pdims = tuple(j for j, x in enumerate(sc) if x <= -2)
    if not pdims:
        lack = lack_of(own_s, own_d)
        return TransferWalk(fine, s, d, ndim, (TransferOption(None, s, lack),),
                        ((None, (), 1, 1, lack),), ((fine, s, d, ndim),))
    div = divisor(fine, sc, pdims)   # the same reduced piece for every option
    # rank 0's boxes: the partial dims split nothing, so the broadcast option's box is the
    # source's, and a split of axis a cuts that axis by their product more (each lack equals
    # the lack of mid's own box up to rounding, far below the 1e-12 a floor takes off)
    g = math.prod(fine[j] for j in pdims)
    lack = lack_of(own_s, own_d)
    out = [TransferOption(("all_reduce", pdims, div, 0), _with(s, pdims, B), lack)]
    least = [("all_reduce", pdims, div, g, lack)]
    mid = list(sc)
    for a in range(ndim):
        for j in pdims:
            mid[j] = a
        if _valid(sc, mid, pdims):
            own = list(own_s)
            own[a] = own[a] / g
            lack = lack_of(own, own_d)
            out.append(TransferOption(("reduce_scatter", pdims, div, a), _with(s, pdims, _split(a)),
                                      lack))
            if len(least) == 1 or lack < least[1][4]:
                least[1:] = [("reduce_scatter", pdims, div, g, lack)]
    return TransferWalk(fine, s, d, ndim, tuple(out), tuple(least),
                    tuple((fine, o.mid, d, ndim) for o in out))


def lack_of(own_s: list, own_d: list) -> float:
    """What a rank whose source box is ``own_s`` lacks of its destination box ``own_d``
    (both ``[0, x)`` on every axis: rank 0's, `_own_box`)."""
    box, held = own_d[0], min(own_s[0], own_d[0])
    for a in range(1, len(own_d)):
        box *= own_d[a]
        held *= min(own_s[a], own_d[a])
    return box - held


def _with(nd: tuple, dims: tuple, x) -> tuple:
    """``nd`` with ``x`` at the mesh dims ``dims``."""
    out = list(nd)
    for j in dims:
        out[j] = x
    return tuple(out)
