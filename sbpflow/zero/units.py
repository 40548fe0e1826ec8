"""ZeRO on a model (docs/zero.md): `shard_` stores each parameter split along its data-parallel
dims (stages 2 and 3) and has the *unit* that owns it box it to its compute layout around the
unit's ``forward``; stage 1 only registers the split update layout (the optimizer does it).

A unit is a module whose parameters are gathered together: the model itself and each child of
a numbered container (``ModuleList`` / ``Sequential``: a transformer's blocks), as FSDP2 is
usually applied; a parameter belongs to the innermost unit around the module that owns it.
Eagerly a unit's call is one coalesced all-gather whose backward is one reduce-scatter (the
dual of the boxing ``S -> B``, coalesced: `sbpflow.zero.gather`); a graph's trace records
the unit's call as tasks that run the same way at each replay (`sbpflow.zero.unit_tasks`).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from .. import comm as _comm
from ..param_state import mark_filled, mark_stale, set_backfill, set_update_layout, update_layout
from ..tensor import GlobalTensor, recording
from ..utils import IdentityMap
from . import unit_tasks as _graph
from .layout import check_stage, geometry, stored_layout
from .gather import UnitCall, UnitGather, begin_call, done, end_call, refill
from .pending import settle, take_stale

__all__ = ["ZeroParam", "zero_param", "shard_", "units_of", "set_default_on_gather"]


class ZeroParam(NamedTuple):
    """A parameter stored split by `shard_`: its ``compute`` layout, ZeRO ``stage`` and, for a
    stage-2 parameter that keeps it, the ``whole`` compute-layout local its shard is a view of
    (refilled after each update by the optimizer)."""

    compute: tuple
    stage: int
    whole: torch.Tensor | None = None


_PARAMS = IdentityMap()
_DEFAULT_ON_GATHER: list = [None]


def set_default_on_gather(fn: Callable | None) -> None:
    """The ``on_gather`` of `shard_` when it is given none (`sbpflow.zero.release` sets
    stage 3's release and the memory accounting)."""
    _DEFAULT_ON_GATHER[0] = fn


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
           only: set | None = None, keep_whole: bool = True) -> list:
    """ZeRO ``stage`` on ``model``'s parameters, in place; returns the names it shards: those
    with a data-parallel dim (`stored_layout`), at least ``min_size`` elements and a gradient.
    Stage 1 registers the split update layout; stages 2 and 3 box each to its stored layout
    (unless already there: ``compute`` maps id(parameter) -> compute layout for parameters
    laid out stored already) and hook the units (``units``: module names, default
    `units_of`). ``on_gather(call)``, given an eager unit call (`UnitCall`) as it gathers,
    may return a context manager held over the call (stage 3's release of the gathered
    copies: `sbpflow.zero.release`). ``only``: ids of the parameters to consider (default
    all). ``keep_whole`` (stage 2): keep each parameter's whole compute-layout copy between
    steps, its shard a view of it, refilled by an all-gather after each update (DeepSpeed's
    stage 2; a graph passes False: its replay gathers in forward). Every rank calls it."""
    stage = check_stage(stage, "ZeRO")
    on_gather = on_gather if on_gather is not None else _DEFAULT_ON_GATHER[0]
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
            set_backfill(p, None, nd)
            continue
        whole = None
        with torch.no_grad():
            if stage == 2 and keep_whole:
                whole = p.to_global(p.placement, nd).local.clone()
                geo = geometry(tuple(p.shape), p.placement, nd, st, _rank())
                # a rank outside the placement takes the layout too (its shard, as its whole
                # copy, is empty): every rank must agree on a global tensor's layout
                _rebind(p, whole if geo is None else
                        whole.narrow(geo.axis, *geo.parts[geo.index]), st)
                if geo is not None:
                    set_backfill(p, whole, nd)
                    mark_filled(p)
            elif tuple(p.sbp) != st:
                _rebind(p, p.to_global(p.placement, st).local.clone(), st)
        _PARAMS[p] = ZeroParam(nd, stage, whole)
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
        state["_zero_unit_name"] = unit
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
    _adopt_replaced(entries)
    live, items = _unit_items(module)
    if not items:
        if not recording():
            begin_call(module, items, None)
        module.__dict__["_zero_calls"].append(([], None, module))
        return
    wholes = [_PARAMS[p].whole for p, _ in items]
    kept = all(w is not None for w in wholes)   # stage 2: the whole copies, kept
    if kept:   # written since they were filled (an in-place op, an init, a load): gathered
        stale = set(map(id, take_stale([p for p, _ in items])))
        refill([(w, p, nd) for w, (p, nd) in zip(wholes, items) if id(p) in stale])
    if recording():   # the graph records the call (and replays it as below)
        gathered, call = _graph.record_begin(module.__dict__["_zero_unit_name"], items,
                                             wholes if kept else None, on_gather)
    else:
        if kept:
            begin_call(module, [], None)
            call = UnitCall(items, done(([w.view_as(w) for w in wholes], [])))
        else:
            call = begin_call(module, items, _gathered_items)
        outs = UnitGather.apply(call, *[p.local for p, _ in items])
        gathered = [GlobalTensor(o, tuple(p.shape), p.placement, nd)
                    for o, (p, nd) in zip(outs, items)]
    swapped = []
    for (p, owners), g in zip(live, gathered):
        for m, k in owners:
            if m._parameters.get(k) is p:
                m._parameters[k] = g
                swapped.append((m, k, p))
    ctx = on_gather(call) if isinstance(call, UnitCall) and on_gather is not None else None
    if ctx is not None:
        ctx.__enter__()
    module.__dict__["_zero_calls"].append((swapped, ctx, call))


def _adopt_replaced(entries: list) -> None:
    """Give a parameter registered where a ZeRO parameter of the unit was (``Module.to(dtype)``
    makes new ones, in the same layout) the old one's ZeRO records, in ``entries`` too: the
    unit goes on gathering it, its update layout stays split (stage 1) and stage 2's whole
    copy is cast with it. Others (another layout, a gathered copy put there by a unit's
    call) are left alone."""
    for i, (p, owners) in enumerate(entries):
        now = [m._parameters.get(k) for m, k in owners]
        if any(q is p for q in now):
            continue
        # a parameter is of a GlobalTensor subclass (sf.nn.Parameter: optim does not import
        # nn, its peer); a unit's gathered copy is a plain GlobalTensor
        q = next((q for q in now if isinstance(q, GlobalTensor) and type(q) is not GlobalTensor),
                 None)
        if q is None or q in _PARAMS or tuple(q.shape) != tuple(p.shape) or \
                tuple(q.sbp) != tuple(p.sbp):
            continue
        rec = _PARAMS.get(p)
        if rec is None:
            if update_layout(p) != tuple(p.sbp):   # stage 1
                set_update_layout(q, update_layout(p))
                set_backfill(q, None, tuple(q.sbp))
        else:
            _PARAMS[q] = rec._replace(whole=_adopt_whole(q, rec))
        entries[i] = (q, owners)


def _adopt_whole(q: GlobalTensor, rec: ZeroParam) -> torch.Tensor | None:
    """Stage 2: ``q``'s whole copy, its shard a view of it holding ``q``'s own values (written
    since the cast, by a load, as well), marked stale: the unit's call gathers the other
    members' parts, once (every rank adopts in the same call)."""
    if rec.whole is None:
        return None
    with torch.no_grad():
        whole = torch.empty_like(rec.whole, dtype=q.dtype)
        geo = geometry(tuple(q.shape), q.placement, rec.compute, tuple(q.sbp), _rank())
        if geo is not None:
            part = whole.narrow(geo.axis, *geo.parts[geo.index])
            part.copy_(q.local)
            _rebind(q, part, q.sbp)
    set_backfill(q, whole, rec.compute)
    mark_stale(q)
    return whole


def _gathered_items(module) -> list:
    """The items a unit gathers in forward (none for one whose whole copies are kept)."""
    items = _unit_items(module)[1]
    return [] if any(_PARAMS[p].whole is not None for p, _ in items) else items


def _rank() -> int:
    return _comm.rank()


def _post_forward(module, args, output) -> None:
    calls = module.__dict__.get("_zero_calls")
    if not calls:
        return
    swapped, ctx, call = calls.pop()
    for m, k, p in swapped:
        m._parameters[k] = p
    if ctx is not None:
        ctx.__exit__(None, None, None)
    if isinstance(call, _graph.Recorded):
        _graph.record_end(call)
    elif call is module:
        end_call(module)
    elif call is not None:
        call.flats = []   # the buffers live on only where autograd saved them (stage 2)
        end_call(module)
