"""Layout: where a global tensor lives (a placement) and how it is laid out there (an nd-sbp).

    >>> mesh = placement("cpu", ranks=[[0, 1], [2, 3]])
    >>> lay = Layout(mesh, "S(0), B")
    >>> print(lay, "|", lay.dual())
    cpu[[0,1],[2,3]] (S(0), B) | cpu[[0,1],[2,3]] (S(0), P)

A `Layout` is a ``(placement, sbp)`` pair: it unpacks, indexes, hashes and compares as that
tuple, so code that passes pairs keeps working and both forms hit the same caches. ``sbp`` is
always a parsed nd-sbp tuple with one sbp per mesh dim. ``dual()`` is the gradient's layout
(docs/design.md, 'Gradients: the dual layout'). ``repr`` is for machines, ``str`` for people.
"""

from __future__ import annotations

from typing import NamedTuple

from .errors import PlacementError, SbpParseError
from .placement import Placement, placement  # noqa: F401 (the docstring's example)
from .sbp import SbpLike, dual_nd, format_nd_sbp, parse_nd_sbp

__all__ = ["Layout", "as_layout"]


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
