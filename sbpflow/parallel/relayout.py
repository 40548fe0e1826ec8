"""``sf.parallel.relayout``: move every parameter of a model to a new layout -- the one routine
behind `sf.parallel.apply` (layouts by name) and ``sf.auto.parallelize`` (layouts by strategy).

Each parameter is given its layout by a function of its name and the parameter itself, and is
re-registered as a fresh leaf `Parameter` (requiring grad as before) under every name it has,
so tied parameters stay tied. A parameter built under `sf.nn.init.meta_init` (its shard a
``meta`` tensor, no storage) is *materialised* directly in its new layout: each rank allocates
only its shard, holding the values an ordinary build would have had. Any other parameter is
boxed there (a collective). Buffers are left as they are. Build the optimizer afterwards: it
holds the parameter objects (the step of one built before raises `OptimizerStateError`).
"""

from __future__ import annotations

from typing import Callable

from ..errors import SbpError
from ..layouts import Layout
from ..param_state import mark_replaced
from ..nn.init import materialize
from ..nn.modules import Module, Parameter
from ..placement import Placement
from ..sbp import parse_nd_sbp
from ..tensor import GlobalTensor

__all__ = ["relayout"]

LayoutOf = Callable[[str, Parameter], "Layout | tuple[Placement, tuple]"]


def relayout(model: Module, layout_of: LayoutOf, who: str = "sf.parallel.relayout") -> Module:
    """Re-lay every parameter of ``model`` to ``layout_of(name, parameter)``, an `sf.Layout`
    or a (placement, nd-sbp) pair; returns ``model``. Meta parameters are materialised in that
    layout, others boxed.

    Every rank must call it with the same layouts (the boxing is collective); parameters are
    visited once each, in registration order, the same on every rank. Each new parameter holds
    the placement object ``layout_of`` gave (the dispatch compares placements by identity
    first: equal placements from module init would be compared by value on every op). An
    `SbpError` of one parameter is re-raised naming ``who``, the parameter, its shape and
    target layout."""
    new: dict = {}
    for name, p in model.named_parameters():
        placement, nd = layout_of(name, p)
        try:
            nd = parse_nd_sbp(nd, placement.ndim)
            t = materialize(p, placement, nd)
        except SbpError as exc:
            raise type(exc)(f"{who}: parameter {name!r} of shape {tuple(p.shape)} to "
                            f"{placement} with sbp {nd!r}: {exc}") from None
        if t.placement is not placement:
            t = GlobalTensor(t.local, tuple(t.shape), placement, t.sbp)
        new[id(p)] = Parameter(t, requires_grad=p.requires_grad)
        mark_replaced(p, name, who)   # an optimizer built before holds it: its step raises
    for m in model.modules():
        for key, p in list(m._parameters.items()):
            if p is not None and id(p) in new:
                m._parameters[key] = new[id(p)]
    return model

