"""``sf.parallel.apply``: lay out a model's parameters by name.

``rules`` maps fnmatch patterns over ``named_parameters()`` names to nd-sbps or to styles
resolved against each parameter's module (`sf.parallel.colwise`, parallel/styles.py); the first
pattern that matches a name wins (dict order), ``"*"`` is the usual fallback::

    sf.parallel.apply(model, mesh, {"*.fc1.*": sf.parallel.colwise,   # (B, S(0)) on a 2-D mesh
                                    "*.fc2.*": sf.parallel.rowwise, "*": (sf.B, sf.B)})

Each parameter is boxed to ``placement`` with its nd-sbp (materialised there if built under
`sf.nn.init.meta_init`) and re-registered as a fresh leaf `Parameter` under every name it has:
tied parameters stay tied (`sf.parallel.relayout`). Build the optimizer afterwards: it holds
the parameter objects. ``zero=1|2|3`` adds ZeRO along the dims where a rule says ``B``
(docs/zero.md); stage 2 and 3 parameters are materialised straight in their split layout.
"""

from __future__ import annotations

import fnmatch
from typing import Mapping

from ..errors import SbpError, UnmatchedParameterError
from ..nn.modules import Module
from ..nn.torch_layouts import warn_narrow_splits, watch_fused_splits
from ..nn.torch_modules import from_torch, is_torch_module
from ..placement import Placement
from ..sbp import parse_nd_sbp
from . import zero as _zero
from .relayout import relayout
from .styles import Style

__all__ = ["apply", "match_rules", "UnmatchedParameterError"]


def match_rules(names, rules: Mapping, placement: Placement, model=None,
                prefix: str = "") -> dict:
    """``{name: nd_sbp}`` by first matching pattern; raises `UnmatchedParameterError`. A rule
    whose value is a `Style` is resolved against the parameter's module in ``model`` (needed
    then; ``prefix``: the name of ``model`` within the names, when it is a submodule)."""
    parsed = [(pattern, _parsed_rule(pattern, value, placement, model))
              for pattern, value in rules.items()]
    out, unmatched = {}, []
    for name in names:
        nd = next((nd for pattern, nd in parsed if fnmatch.fnmatchcase(name, pattern)), None)
        if nd is None:
            unmatched.append(name)
        elif isinstance(nd, Style):
            module, attr = _owner(model, name.removeprefix(f"{prefix}.") if prefix else name)
            out[name] = nd.resolve(module, attr, tuple(module._parameters[attr].shape),
                                   placement)
        else:
            out[name] = nd
    if unmatched:
        raise UnmatchedParameterError(
            f"sf.parallel.apply: no rule matches parameter(s) {unmatched} (patterns "
            f"{list(rules)}, on {placement}); add a rule or a '*' fallback")
    return out


def _parsed_rule(pattern: str, value, placement: Placement, model):
    """A rule's nd-sbp, or its `Style` (checked against the placement's dims)."""
    try:
        if isinstance(value, Style):
            if model is None:
                raise SbpError(f"the style {value!r} needs the model to resolve against; "
                               f"pass model= to match_rules")
            value.tp_dim(placement)
            return value
        return parse_nd_sbp(value, placement.ndim)
    except SbpError as exc:
        raise type(exc)(f"rule {pattern!r} on {placement}: {exc}") from None


def _owner(model, name: str) -> tuple:
    """(module, attribute name) of parameter ``name`` of ``model``."""
    mod_name, _, attr = name.rpartition(".")
    return (model.get_submodule(mod_name) if mod_name else model), attr


def apply(model, placement: Placement, rules: Mapping, zero: int = 0,
          zero_min_size: int = 0) -> Module:
    """Re-lay every parameter of ``model`` onto ``placement`` by ``rules``; returns the model
    to call: ``model`` itself, or for a plain ``torch.nn.Module`` its sbpflow conversion
    (`sf.nn.from_torch`, whose values are the placement's first rank's on every rank; the torch
    model is left as it was).

    Every rank must call it (the boxing is collective), with the same rules. A model built
    under `sf.nn.init.meta_init` is materialised in these layouts (`relayout`). ``zero``: the
    ZeRO stage (0: none) along the dims where a rule says ``B``, for parameters of at least
    ``zero_min_size`` elements (`sf.parallel.zero.shard`)."""
    if not isinstance(placement, Placement):
        raise SbpError(f"sf.parallel.apply: expected an sf.placement, got {placement!r}")
    stage = _zero.check_stage(zero, "sf.parallel.apply")
    zero_min_size = _zero.check_min_size(zero_min_size, "sf.parallel.apply")
    if is_torch_module(model):
        model = from_torch(model, placement)
    names = [n for n, _ in model.named_parameters()]
    layouts = match_rules(names, rules, placement, model)
    warn_narrow_splits(model, placement, layouts)
    stored = {}   # stages 2 and 3: straight to the split layout (no whole copy on each rank)
    if stage >= 2:
        for name, p in model.named_parameters():
            st = _zero.stored_layout(tuple(p.shape), layouts[name], placement)
            if st is not None and p.numel() >= zero_min_size and p.requires_grad:
                stored[name] = st
    relayout(model, lambda name, _: (placement, stored.get(name, layouts[name])),
             "sf.parallel.apply")
    if stage:
        compute = {id(p): layouts[name] for name, p in model.named_parameters()}
        _zero.shard(model, stage, zero_min_size, compute=compute)
    watch_fused_splits(model, placement, layouts)  # warns of a split the model cuts again
    return model
