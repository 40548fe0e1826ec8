"""ZeRO on a model (docs/zero.md): `shard_` stores each parameter split along its data-parallel
dims (stages 2 and 3) and has the *unit* that owns it box it to its compute layout around the
unit's ``forward``; stage 1 only registers the split update layout (the optimizer does it).

A unit is a module whose parameters are gathered together: the model itself and each child of
a numbered container (``ModuleList`` / ``Sequential``: a transformer's blocks), as FSDP2 is
usually applied; a parameter belongs to the innermost unit around the module that owns it.
Eagerly a unit's call is one coalesced all-gather whose backward is one reduce-scatter (the
dual of the boxing ``S -> B``, coalesced: `sbpflow.optim.zero_gather`); in a graph's trace each
parameter is boxed with ``to_global``, which the graph records and replays.
"""

from __future__ import annotations

import weakref
from typing import Callable, NamedTuple

import torch

from ..gradsync import set_update_layout, settle
from ..tensor import GlobalTensor, recording
from .zero import check_stage, stored_layout
from .zero_gather import UnitGather, begin_call, end_call

__all__ = ["ZeroParam", "zero_param", "shard_", "units_of"]


class ZeroParam(NamedTuple):
    """A parameter stored split by `shard_`: its ``compute`` layout and ZeRO ``stage``."""

    compute: tuple
    stage: int


_PARAMS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def zero_param(p: GlobalTensor) -> ZeroParam | None:
    """The `ZeroParam` record of ``p`` (None: not stored split by `shard_`)."""
    return _PARAMS.get(p)


def _rebind(p: GlobalTensor, local: torch.Tensor, nd_sbp: tuple) -> None:
    """Make ``p`` itself hold ``local`` in ``nd_sbp``: the objects the optimizer and the
    modules hold stay the same (so a graph can enable ZeRO after its optimizer was built)."""
    p._local = local.detach().requires_grad_(p._local.requires_grad)
    p._sbp = tuple(nd_sbp)
    p._key = None
    p._boxes = None


def units_of(model) -> list:
    """Names of ``model``'s units: ``""`` (the model) and every child of a module whose
    children are all numbered (a ``ModuleList`` or ``Sequential``), outermost first."""
    out = [""]
    for name, m in model.named_modules():
        kids = list(m._modules)
        if kids and all(k.isdigit() for k in kids):
            out += [f"{name}.{k}" if name else k for k in kids if m._modules[k] is not None]
    return out


def shard_(model, stage: int, min_size: int = 0, *, compute: dict | None = None,
           on_gather: Callable | None = None, units: list | None = None,
           only: set | None = None) -> list:
    """ZeRO ``stage`` on ``model``'s parameters, in place; returns the names it shards: those
    with a data-parallel dim (`stored_layout`), at least ``min_size`` elements and a gradient.
    Stage 1 registers the split update layout; stages 2 and 3 box each to its stored layout
    (unless already there: ``compute`` maps id(parameter) -> compute layout for parameters
    laid out stored already) and hook the units (``units``: module names, default
    `units_of`). ``on_gather(call)``, given an eager unit call (`UnitCall`) as it gathers,
    may return a context manager held over the call (stage 3's release of the gathered
    copies: `sbpflow.parallel.zero`). ``only``: ids of the parameters to consider (default
    all). Every rank calls it, with the same arguments."""
    stage = check_stage(stage, "ZeRO")
    compute = compute or {}
    names, owned = [], {}
    for name, p in model.named_parameters():
        if only is not None and id(p) not in only:
            continue
        nd = tuple(compute.get(id(p), p.sbp))
        st = stored_layout(tuple(p.shape), nd, p.placement)
        if stage == 0 or st is None or p.numel() < min_size or not p.local.requires_grad:
            continue
        names.append(name)
        owned[id(p)] = name
        if stage == 1:
            set_update_layout(p, st)
            continue
        if tuple(p.sbp) != st:
            with torch.no_grad():
                _rebind(p, p.to_global(p.placement, st).local.clone(), st)
        _PARAMS[p] = ZeroParam(nd, stage)
    if owned:
        _hook_units(model, owned, units if units is not None else units_of(model), on_gather)
    return names


def _hook_units(model, owned: dict, unit_names: list, on_gather) -> None:
    """Give each unit its parameters (those of ``owned`` whose first name falls in it and in
    no inner unit) with every (module, name) they are registered under inside the unit."""
    unit_names = sorted(set(unit_names), key=lambda n: -len(n.split("."))if n else 0)
    by_unit: dict = {}
    for prefix, m in model.named_modules():
        for key, p in m._parameters.items():
            if p is None or id(p) not in owned:
                continue
            first = owned[id(p)]
            unit = next(u for u in unit_names if u == "" or first == u or
                        first.startswith(u + "."))
            entries = by_unit.setdefault(unit, {})
            entries.setdefault(id(p), (p, []))[1].append((m, key))
    by_unit.setdefault("", {})   # the model: the outermost call bounds a forward (prefetch)
    for unit, entries in by_unit.items():
        module = model.get_submodule(unit)
        state = module.__dict__
        state["_zero_unit"] = (list(entries.values()), on_gather)
        if not state.get("_zero_hooked"):
            state["_zero_hooked"] = True
            state["_zero_calls"] = []
            module.register_forward_pre_hook(_pre_forward)
            module.register_forward_hook(_post_forward, always_call=True)


def _unit_items(module) -> tuple[list, list]:
    """The unit's parameters still registered where it put them, with their owners, and its
    (parameter, compute layout) items."""
    entries, _ = module.__dict__["_zero_unit"]
    live = [(p, owners) for p, owners in entries
            if p in _PARAMS and any(m._parameters.get(k) is p for m, k in owners)]
    return live, [(p, _PARAMS[p].compute) for p, _ in live]


def _pre_forward(module, args) -> None:
    entries, on_gather = module.__dict__["_zero_unit"]
    settle([p for p, _ in entries])   # stage 1: the gathers after the last update
    live, items = _unit_items(module)
    if not items:
        if not recording():
            begin_call(module, items, None)
        module.__dict__["_zero_calls"].append(([], None, module))
        return
    if recording():   # the graph records (and replays) one boxing per parameter
        gathered = [p.to_global(p.placement, nd) for p, nd in items]
        call = None
    else:
        call = begin_call(module, items, lambda m: _unit_items(m)[1])
        outs = UnitGather.apply(call, *[p.local for p, _ in items])
        gathered = [GlobalTensor(o, tuple(p.shape), p.placement, nd)
                    for o, (p, nd) in zip(outs, items)]
    swapped = []
    for (p, owners), g in zip(live, gathered):
        for m, k in owners:
            if m._parameters.get(k) is p:
                m._parameters[k] = g
                swapped.append((m, k, p))
    ctx = on_gather(call) if call is not None and on_gather is not None else None
    if ctx is not None:
        ctx.__enter__()
    module.__dict__["_zero_calls"].append((swapped, ctx, call))


def _post_forward(module, args, output) -> None:
    calls = module.__dict__.get("_zero_calls")
    if not calls:
        return
    swapped, ctx, call = calls.pop()
    for m, k, p in swapped:
        m._parameters[k] = p
    if ctx is not None:
        ctx.__exit__(None, None, None)
    if call is module:
        end_call(module)
    elif call is not None:
        call.flats = []   # the buffers live on only where autograd saved them (stage 2)
        end_call(module)
