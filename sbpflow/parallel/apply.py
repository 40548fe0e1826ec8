"""``sf.parallel.apply``: lay out a model's parameters by name.

``rules`` maps fnmatch patterns over ``named_parameters()`` names to nd-sbps; the first pattern
that matches a name wins (dict order), ``"*"`` is the usual fallback::

    sf.parallel.apply(model, mesh, {
        "*.fc1.weight": (sf.B, sf.S(0)),   # column parallel inside a group
        "*.fc1.bias":   (sf.B, sf.S(0)),
        "*.fc2.weight": (sf.B, sf.S(1)),   # row parallel
        "*":            (sf.B, sf.B),
    })

Each parameter is boxed to ``placement`` with its nd-sbp and re-registered as a fresh leaf
`Parameter` (requires grad as before) under every name it has — tied parameters stay tied.
Call it before building the optimizer: the optimizer holds the parameter objects.
"""

from __future__ import annotations

import fnmatch
from typing import Mapping

from ..errors import SbpError
from ..nn.modules import Module, Parameter
from ..placement import Placement
from ..sbp import format_nd_sbp, parse_nd_sbp
from ..tensor import GlobalTensor

__all__ = ["apply", "match_rules", "UnmatchedParameterError"]


class UnmatchedParameterError(SbpError, ValueError):
    """Some parameters match no rule (and there is no ``"*"`` fallback)."""


def match_rules(names, rules: Mapping, placement: Placement) -> dict:
    """``{name: nd_sbp}`` by first matching pattern; raises `UnmatchedParameterError`."""
    parsed = []
    for pattern, sbp in rules.items():
        try:
            parsed.append((pattern, parse_nd_sbp(sbp, placement.ndim)))
        except SbpError as exc:
            raise type(exc)(f"rule {pattern!r}: {exc}") from None
    out, unmatched = {}, []
    for name in names:
        nd = next((nd for pattern, nd in parsed if fnmatch.fnmatchcase(name, pattern)), None)
        if nd is None:
            unmatched.append(name)
        else:
            out[name] = nd
    if unmatched:
        raise UnmatchedParameterError(
            f"sf.parallel.apply: no rule matches parameter(s) {unmatched} (patterns "
            f"{list(rules)}, on {placement}); add a rule or a '*' fallback")
    return out


def apply(model: Module, placement: Placement, rules: Mapping) -> Module:
    """Re-lay every parameter of ``model`` onto ``placement`` by ``rules``; returns ``model``.

    Every rank must call it (the boxing is collective), with the same rules."""
    if not isinstance(placement, Placement):
        raise SbpError(f"sf.parallel.apply: expected an sf.placement, got {placement!r}")
    named = list(model.named_parameters())
    layouts = match_rules([n for n, _ in named], rules, placement)
    new = {}
    for name, p in named:  # each parameter once, in registration order (same on every rank)
        nd = layouts[name]
        try:
            boxed = p.detach().to_global(placement, nd)
        except SbpError as exc:
            raise type(exc)(f"sf.parallel.apply: parameter {name!r} of shape {tuple(p.shape)} "
                            f"to {placement} with sbp {format_nd_sbp(nd)}: {exc}") from None
        if boxed.placement is not placement:  # an equal one: share the given object, which
            # the dispatch then compares by identity, not by value, on every op
            boxed = GlobalTensor(boxed.local, tuple(boxed.shape), placement, boxed.sbp)
        new[id(p)] = Parameter(boxed, requires_grad=p.requires_grad)
    for m in model.modules():
        for key, p in list(m._parameters.items()):
            if p is not None and id(p) in new:
                m._parameters[key] = new[id(p)]
    return model
