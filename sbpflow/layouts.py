"""Layout: where a global tensor lives (a placement) and how it is laid out there (an nd-sbp);
MeshLayout: the same on a mesh shape without ranks (the strategy search's layouts).

    >>> mesh = placement("cpu", ranks=[[0, 1], [2, 3]])
    >>> lay = Layout(mesh, "S(0), B")
    >>> print(lay, "|", lay.dual(), "|", MeshLayout.of(lay))
    cpu[[0,1],[2,3]] (S(0), B) | cpu[[0,1],[2,3]] (S(0), P) | mesh(2, 2) (S(0), B)

A `Layout` is a ``(placement, sbp)`` pair and a `MeshLayout` a ``(mesh, sbp)`` pair: each
unpacks, indexes, hashes and compares as that tuple, so code that passes pairs keeps working and
both forms hit the same caches. ``sbp`` is a parsed nd-sbp tuple, one sbp per mesh dim.
``dual()`` is the gradient's layout (`sbpflow.sbp.dual_nd`, docs/design.md, 'Gradients: the dual
layout'). ``repr`` is for machines, ``str`` for people.
"""

from __future__ import annotations

import functools
import numbers
import warnings

from typing import NamedTuple

from .errors import PlacementError, SbpParseError
from .placement import Placement, placement
from .sbp import SbpLike, dual_nd, format_nd_sbp, parse_nd_sbp

__all__ = ["Layout", "MeshLayout", "as_layout", "from_quartet", "takes_mesh_layouts"]


class _Pair(NamedTuple):
    placement: Placement
    sbp: tuple


class Layout(_Pair):
    """A placement and an nd-sbp on it: frozen, hashable, equal to the ``(placement, sbp)``
    tuple it holds. ``Layout(pl, sf.S(0))``, ``Layout(mesh, (sf.S(0), sf.B))`` and
    ``Layout(mesh, "S(0), B")`` parse the sbp (one per mesh dim, else `SbpParseError`)."""

    __slots__ = ()

    def __new__(cls, placement: Placement, sbp: SbpLike) -> "Layout":
        if not isinstance(placement, Placement):
            raise PlacementError(f"a Layout needs a Placement (sf.placement(...)), got "
                                 f"{placement!r} with sbp {sbp!r}")
        return tuple.__new__(cls, (placement, parse_nd_sbp(sbp, placement.ndim)))

    @classmethod
    def parsed(cls, placement: Placement, nd_sbp: tuple) -> "Layout":
        """The Layout of an nd-sbp already parsed and checked for ``placement`` (a tensor's,
        a signature's), made without parsing again: for the paths that run per op or step."""
        return tuple.__new__(cls, (placement, nd_sbp))

    def dual(self) -> "Layout":
        """The layout of this tensor's gradient: ``S(a)`` stays, ``B`` <-> ``P``; ``P(max)`` /
        ``P(min)`` carry no gradient (`SbpParseError`)."""
        return tuple.__new__(Layout, (self.placement, dual_nd(self.sbp)))

    def __repr__(self) -> str:
        return f"Layout({self.placement!r}, {self.sbp!r})"

    def __str__(self) -> str:
        return f"{self.placement} {format_nd_sbp(self.sbp)}"


def as_layout(value: "Layout | tuple") -> Layout:
    """``value`` as a `Layout`: a Layout is returned as it is; a ``(placement, sbp)`` pair is
    parsed (`Layout`'s rules)."""
    if type(value) is Layout:
        return value
    try:
        pl, sbp = value
    except (TypeError, ValueError):
        raise SbpParseError(f"a layout is a Layout or a (placement, sbp) pair, got {value!r}; "
                            f"e.g. sf.Layout(sf.placement('cpu', [0, 1]), sf.S(0))") from None
    return Layout(pl, sbp)


class MeshLayout(NamedTuple):
    """A mesh shape (no ranks: ``(8, 4)`` is 8 x 4 devices) and an nd-sbp on it, what the
    strategy search (`sbpflow.auto`) gives a tensor; equal to and hashed as the ``(mesh,
    sbp)`` tuple. ``MeshLayout((8, 4), (S(0), B))`` stores what it is given, unparsed (the
    search builds many and keeps them as dict keys): ``mesh`` a tuple of ints, ``sbp`` a tuple
    of one sbp per mesh dim; `parse` checks and parses."""

    mesh: tuple
    sbp: tuple

    @classmethod
    def parse(cls, mesh, sbp: SbpLike) -> "MeshLayout":
        """``mesh`` (ints >= 1) and ``sbp`` (any form `Layout` takes) checked and parsed:
        `SbpParseError` unless one sbp per mesh dim; `PlacementError` for a bad mesh."""
        ok = isinstance(mesh, (tuple, list)) and len(mesh) > 0 and all(
            isinstance(d, numbers.Integral) and not isinstance(d, bool) and d >= 1 for d in mesh)
        if not ok:
            raise PlacementError(f"a MeshLayout's mesh is a shape of ints >= 1 such as (8, 4), "
                                 f"got {mesh!r} with sbp {sbp!r}")
        return tuple.__new__(cls, (tuple(int(d) for d in mesh), parse_nd_sbp(sbp, len(mesh))))

    @classmethod
    def of(cls, layout: "Layout | tuple") -> "MeshLayout":
        """The MeshLayout of a `Layout` (or ``(placement, sbp)`` pair): its placement's mesh
        shape, its nd-sbp; the ranks are dropped."""
        lay = as_layout(layout)
        return tuple.__new__(cls, (tuple(lay.placement.shape), lay.sbp))

    def on(self, ranks: "Placement | list", device_type: str = "cpu") -> Layout:
        """The `Layout` of this layout on ``ranks``: a `Placement` of as many ranks as the mesh
        holds (reshaped, row-major, to the mesh) or a list of ranks (a ``device_type`` one).
        `PlacementError` when the counts differ."""
        pl = ranks if isinstance(ranks, Placement) else placement(device_type, list(ranks))
        n = 1
        for d in self.mesh:
            n *= d
        if pl.size != n:
            raise PlacementError(f"{self} needs {n} ranks, got {pl.size} ({pl}); give a "
                                 f"placement of {n} ranks")
        if tuple(pl.shape) != tuple(self.mesh):
            pl = pl.reshape(*self.mesh)
        return Layout(pl, self.sbp)

    def dual(self) -> "MeshLayout":
        """The layout of this tensor's gradient (`Layout.dual`'s rule, `sbpflow.sbp.dual_nd`):
        ``S(a)`` stays, ``B`` <-> ``P``; ``P(max)`` / ``P(min)`` carry none (`SbpParseError`)."""
        return tuple.__new__(MeshLayout, (self.mesh, dual_nd(self.sbp)))

    def __repr__(self) -> str:
        return f"MeshLayout({tuple(self.mesh)!r}, {tuple(self.sbp)!r})"

    def __str__(self) -> str:
        return f"mesh({', '.join(str(d) for d in self.mesh)}) {format_nd_sbp(self.sbp)}"


def _is_mesh(x) -> bool:
    """Whether ``x`` is a mesh shape (the old form's first argument) rather than a layout."""
    return type(x) is not MeshLayout and isinstance(x, (tuple, list)) and len(x) > 0 and \
        isinstance(x[0], numbers.Integral)


def from_quartet(name: str, src_mesh, src_sbp, rest: tuple) -> tuple:
    """``(src, dst, rest[2:])`` of an old-form call ``name(..., src_mesh, src_sbp, *rest)``
    whose ``rest`` starts with ``dst_mesh, dst_sbp``: two `MeshLayout` s, with a
    DeprecationWarning (the form works for one release); `TypeError` if it is not that form."""
    if len(rest) < 2 or not _is_mesh(src_mesh) or not _is_mesh(rest[0]):
        raise TypeError(f"{name} takes two MeshLayouts (src, dst), got "
                        f"{(src_mesh, src_sbp) + tuple(rest)!r}; e.g. sf.auto.MeshLayout((8, 4), "
                        f"(sf.S(0), sf.B))")
    warnings.warn(f"{name}(..., src_mesh, src_sbp, dst_mesh, dst_sbp, ...) is deprecated: pass "
                  f"two layouts, sf.auto.MeshLayout(src_mesh, src_sbp) and MeshLayout(dst_mesh, "
                  f"dst_sbp)", DeprecationWarning, stacklevel=3)
    return (MeshLayout(tuple(src_mesh), tuple(src_sbp)),
            MeshLayout(tuple(rest[0]), tuple(rest[1])), tuple(rest[2:]))


def takes_mesh_layouts(at: int):
    """Decorator of a function whose arguments ``at`` and ``at + 1`` are two `MeshLayout` s
    (source, destination): it also takes the old form with four there, ``src_mesh, src_sbp,
    dst_mesh, dst_sbp`` (`from_quartet`: one release, a DeprecationWarning). A ``(mesh,
    sbp)`` pair passes as it is (it equals its MeshLayout)."""
    def decorate(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            if len(args) > at and _is_mesh(args[at]):
                src, dst, more = from_quartet(fn.__qualname__, args[at], args[at + 1]
                                              if len(args) > at + 1 else None, args[at + 2:])
                args = args[:at] + (src, dst) + more
            return fn(*args, **kwargs)
        return call
    return decorate
