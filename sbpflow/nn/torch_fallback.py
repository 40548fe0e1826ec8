"""Torch functions with no sbpflow handler: run by what torch knows of them, always correctly.

`fallback_for(func, name)` runs a call by the first route: **pointwise** (torch tags its aten
overloads ``torch.Tag.pointwise``: the generic op ``torch_pointwise``, shards stay split);
**reduction** (tagged ``torch.Tag.reduction``, of one tensor along the ``dim`` its schema
binds: the other axes keep their splits); **decomposed** (the aten ops it is made of, each with
a rule: `torch_decomposed`); **replicated** (the generic op ``torch_replicated``: inputs boxed
to ``B``, the bytes counted as "fallback", the function on every rank, outputs ``B``; autograd
and graphs as any op); **eager** for what an op cannot express (a data-dependent shape, a
non-tensor result, a random draw from sbpflow's stream, an unhashable constant, writes into
arguments: the whole values on every rank, written arguments taking their new values; refused
in a graph's build). A gathering call warns once (`ReplicatedFallbackWarning`); a result torch
returns as a view is a copy that re-reads its input and refuses writes (`copy_view`); ``out=``
writes into the given tensors (docs/torch_models.md).
"""

from __future__ import annotations

import threading
import warnings
from typing import Any, Callable

import torch

from .. import comm as _comm
from ..boxing import plan_layouts
from ..caches import BoundedDict
from ..comm.base import counted_as
from ..errors import UnsupportedTorchFunction
from ..layouts import Layout
from ..ops.torch_generic import build_spec, call_spec
from ..placement import Placement
from ..sbp import B, format_nd_sbp
from ..tensor import GlobalTensor, _next_seed, apply_op, copy_view, lift, recording
from .torch_decomposed import decomposed, replay
from .torch_layouts import CostlyLayoutWarning

__all__ = ["fallback_for", "ReplicatedFallbackWarning", "route_of", "is_aten",
           "property_handler"]


class ReplicatedFallbackWarning(CostlyLayoutWarning):
    """A torch function with no sharding rule ran on gathered (replicated) inputs."""


_RNG_LOCK = threading.Lock()  # rank threads share torch's generator: one seeded draw at a time
_WARNED: set = set()
_ROUTES = BoundedDict("nn.torch_fallback.routes")  # (func, specs, metas) -> route


def _packets(func: Callable) -> list:
    """The aten ops of a Python torch function's name (``torch.special.erf`` is
    ``special_erf``, an alias of ``erf``: both); an aten op given as such, itself."""
    if isinstance(func, torch._ops.OpOverload):
        return [func.overloadpacket]
    if isinstance(func, torch._ops.OpOverloadPacket):
        return [func]
    name = getattr(func, "__name__", "") or ""
    names = [name] + ([name[len("special_"):]] if name.startswith("special_") else [])
    found = [getattr(torch.ops.aten, n, None) for n in names if n]
    return [p for p in found if p is not None and hasattr(p, "overloads")]


def _tags(func: Callable) -> set:
    """Every tag of the aten overloads of ``func``'s name (empty when there is no aten op)."""
    tags = set()
    for packet in _packets(func):
        for overload in packet.overloads():
            tags.update(getattr(getattr(packet, overload), "tags", ()))
    return tags


def _is_random(func: Callable, kwargs: dict) -> bool:
    return torch.Tag.nondeterministic_seeded in _tags(func) or "generator" in kwargs


def _returns_view(func: Callable) -> bool:
    """torch returns a view of an input (its schema's first return aliases, without a write)."""
    for packet in _packets(func)[:1]:
        for overload in packet.overloads():
            returns = getattr(packet, overload)._schema.returns
            info = returns[0].alias_info if returns else None
            if info is not None and not info.is_write:
                return True
    return False


def is_aten(func: Callable) -> bool:
    """``func`` is an aten op or torch's binding of one, whatever its name (``torch._chunk_cat``):
    a function of its arguments' values (and of what it writes into them, `_written`)."""
    return bool(_packets(func))


def _written(func: Callable) -> frozenset:
    """The positions of the arguments an aten overload of ``func`` writes into (its schema's
    ``Tensor(a!)`` ones; an ``out=`` overload's keyword-only outputs are not counted)."""
    schemas = [func._schema] if isinstance(func, torch._ops.OpOverload) else \
        [getattr(p, o)._schema for p in _packets(func) for o in p.overloads()]
    return frozenset(i for schema in schemas for i, a in enumerate(schema.arguments)
                     if a.alias_info is not None and a.alias_info.is_write and not a.kwarg_only)


def route_of(func: Callable, tensors: list, pos: tuple, kw: tuple) -> tuple[Any, type | None]:
    """``"pointwise"``, ``("reduction", dims, keepdim)``, ``("decomposed", graph)``,
    ``"replicated"`` or ``"eager"`` (module docstring) for this call, from its function, the
    inputs' metadata and whether autograd records it, and the type torch gives a result of
    several tensors (``torch.return_types.sort``: None for one tensor, a tuple or a list).
    Cached."""
    try:
        key = (func, pos, kw, tuple((t.shape, t.dtype) for t in tensors),
               torch.is_grad_enabled() and tuple(t.requires_grad for t in tensors))
        hash(key)
    except TypeError:  # a constant that is no cache key (a slice, a list in a constant)
        return "eager", None
    route = _ROUTES.get(key)
    if route is None:
        route = _ROUTES.put(key, _find_route(func, tensors, pos, kw))
    return route


def _find_route(func: Callable, tensors: list, pos: tuple, kw: tuple) -> tuple[Any, type | None]:
    if _is_random(func, call_spec(kw, tuple(tensors))):
        return "eager", None
    metas = tuple(torch.empty(t.shape, dtype=t.dtype, device="meta") for t in tensors)
    try:
        with torch.no_grad():
            out = func(*call_spec(pos, metas), **call_spec(kw, metas))
    except Exception:  # noqa: BLE001 - no meta kernel, or a data-dependent shape
        return "eager", None
    several = isinstance(out, (tuple, list))
    outs = out if several else (out,)
    if not outs or not all(isinstance(o, torch.Tensor) for o in outs):
        return "eager", None
    tags = _tags(func)
    if torch.Tag.pointwise in tags:
        route = "pointwise"
    elif torch.Tag.reduction in tags:
        route = _reduction_route(func, tensors, pos, kw, outs)
    else:
        route = "replicated"
    if route == "replicated" and not _returns_view(func):  # (a view's copy re-runs the op)
        graph = decomposed(func, tensors, pos, kw)
        route = route if graph is None else ("decomposed", graph)
    return route, (type(out) if several else None)


def _reduction_route(func: Callable, tensors: list, pos: tuple, kw: tuple, outs) -> Any:
    """``("reduction", dims, keepdim)`` for a reduction of its one tensor (its first
    argument) over ``dims`` read from the aten schema the call binds to, when the outputs have
    the shape that gives; else "replicated"."""
    found = _dims_of(func, tensors, pos, kw)
    if found is None:
        return "replicated"
    dims, keepdim = found
    shape = tuple(1 if a in dims else n for a, n in enumerate(tensors[0].shape)
                  if keepdim or a not in dims)
    if not dims or any(tuple(o.shape) != shape for o in outs):
        return "replicated"
    return ("reduction", dims, keepdim)


def _dims_of(func: Callable, tensors: list, pos: tuple, kw: tuple) -> tuple | None:
    """``(dims, keepdim)`` of a call of one tensor, given first, along the ``dim`` its aten
    schema binds (`_bound_dims`); None for any other call."""
    if len(tensors) != 1 or pos[0] != "T" or not pos[1] or pos[1][0] != ("X", 0):
        return None
    return _bound_dims(func, [call_spec(v, ()) for v in pos[1][1:]],
                       dict(zip(kw[1], (call_spec(v, ()) for v in kw[2]))),
                       len(tensors[0].shape))


def _bound_dims(func: Callable, args: list, kwargs: dict, ndim: int) -> tuple | None:
    """``(dims, keepdim)`` of the first aten overload of ``func`` (not an ``out=`` one) whose
    schema the call's arguments after the tensor bind to, with a ``dim`` argument given."""
    for packet in _packets(func):
        for overload in packet.overloads():
            params = getattr(packet, overload)._schema.arguments[1:]
            if any(p.kwarg_only and p.alias_info is not None for p in params):
                continue  # an out= overload
            names = [p.name for p in params]
            positional = [p.name for p in params if not p.kwarg_only]
            if len(args) > len(positional) or not set(kwargs) <= set(names):
                continue
            bound = {**dict(zip(positional, args)), **kwargs}
            dim = bound.get("dim")
            if "dim" not in names or isinstance(dim, bool) or \
                    not isinstance(dim, (int, list, tuple)):
                continue  # (None, or a dim name)
            dims = (dim,) if isinstance(dim, int) else tuple(dim)
            if not all(isinstance(d, int) and -ndim <= d < max(ndim, 1) for d in dims):
                return None
            return tuple(sorted({d % max(ndim, 1) for d in dims})), bool(bound.get("keepdim",
                                                                              False))
    return None


def _collect(args: tuple, kwargs: dict) -> tuple[list, tuple, tuple, Placement]:
    """The global tensors of a call (plain torch tensors lifted onto their placement), the
    specs of its positional and keyword arguments, and the placement."""
    tensors: list = []
    spec = build_spec((args, kwargs), lambda v: isinstance(v, (GlobalTensor, torch.Tensor)),
                      tensors)
    pl = next(t.placement for t in tensors if isinstance(t, GlobalTensor))
    tensors = [t if isinstance(t, GlobalTensor) else lift(t, pl) for t in tensors]
    return tensors, spec[1][0], spec[1][1], pl


def _warn(func: Callable, name: str, tensors: list, pos: tuple, kw: tuple, pl: Placement,
          route: str) -> None:
    """Once per (function, input layouts): the bytes gathering them to ``B`` moves, and the
    rule that would make the call cheap (`_cheaper`)."""
    replicated = (B,) * pl.ndim
    layouts = tuple((t.shape, t.dtype, t.sbp) for t in tensors)
    if _comm.rank() != pl.flat_ranks[0] or (func, pl, layouts) in _WARNED:
        return
    _WARNED.add((func, pl, layouts))
    moved = sum(plan_layouts(t.shape, t.dtype, Layout.parsed(pl, t.sbp),
                             Layout.parsed(pl, replicated)).nbytes
                for t in tensors if t.sbp != replicated)
    if moved == 0:
        return
    shown = "; ".join(f"{tuple(t.shape)} {format_nd_sbp(t.sbp)}" for t in tensors)
    warnings.warn(
        f"{name} has no sharding rule in sbpflow: it ran {route} on every rank of {pl}, its "
        f"inputs ({shown}) gathered whole ({moved} bytes a call, summed over the ranks; "
        f"counted as 'fallback' in sf.comm.stats()). It is correct, but slow for large "
        f"tensors: {_cheaper(func, tensors, pos, kw)} (docs/torch_models.md, 'What runs')",
        ReplicatedFallbackWarning, stacklevel=4)


def _cheaper(func: Callable, tensors: list, pos: tuple, kw: tuple) -> str:
    """What would make a replicated call cheap: for a function of one tensor along the ``dim``
    its aten schema binds, a rule keeping the other axes' splits (as ``cumsum``'s); else a rule
    of its own, or inputs laid out ``B`` before it."""
    found = _dims_of(func, tensors, pos, kw)
    if found is not None:
        return (f"it works along dim {list(found[0])}, so a rule that keeps a split of any other "
                f"axis (one sf.ops.register, as cumsum's in sbpflow/ops/along.py) would gather "
                f"nothing when the input is split there")
    return ("lay the inputs out B before it where that is cheaper, or register a rule for it "
            "(one sf.ops.register with a signature generator)")


def fallback_for(func: Callable, name: str) -> Callable:
    """The handler running torch function ``func`` (shown as ``name``) on global tensors by the
    first route that applies (module docstring)."""
    view, writes = _returns_view(func), _written(func)

    def run(*args, **kwargs):
        out = kwargs.pop("out", None)
        tensors, pos, kw, pl = _collect(args, kwargs)
        route, kind = ("eager", None) if writes else route_of(func, tensors, pos, kw)
        if route in ("replicated", "eager"):
            _warn(func, name, tensors, pos, kw, pl, route)
        if route == "eager":
            with counted_as("fallback"):
                result = _eager(func, name, tensors, pos, kw, pl, writes)
        else:
            result = _as_op(route, kind, func, tensors, pos, kw)
            if view and tensors:
                result = _copy_views(result, route, kind, func, tensors, pos, kw, name)
        return result if out is None else _write_out(out, result, name)
    run.fallback = True
    return run


def _as_op(route: str, kind: type | None, func: Callable, tensors: list, pos: tuple,
           kw: tuple) -> Any:
    """The call as the generic op of ``route``, its result of several tensors as torch's
    ``kind`` (a ``torch.return_types`` tuple, a list). A replicated call's gathers count as
    "fallback"; a pointwise call's boxing (inputs aligned to one split) as what it is."""
    if route == "replicated":
        with counted_as("fallback"):
            out = apply_op("torch_replicated", *tensors, func=func, pos=pos, kw=kw)
    elif route == "pointwise":
        out = apply_op("torch_pointwise", *tensors, func=func, pos=pos, kw=kw)
    elif route[0] == "decomposed":
        device = _comm.current().device(tensors[0].placement.device_type)
        out = replay(route[1], tensors, device)
        out = tuple(out) if isinstance(out, list) else out
    else:  # ("reduction", dims, keepdim)
        out = apply_op("torch_reduction", *tensors, func=func, pos=pos, kw=kw, dims=route[1],
                       keepdim=route[2])
    if kind is None:
        return out
    outs = out if isinstance(out, tuple) else (out,)
    return list(outs) if kind is list else kind(outs)


def _copy_views(result: Any, route: str, kind: type | None, func: Callable, tensors: list,
                pos: tuple, kw: tuple, name: str) -> Any:
    """Mark the outputs of a function torch returns views from (of its first tensor input):
    remade when that input changes, refused as targets of in-place ops (`copy_view`)."""
    ran = route if isinstance(route, str) else route[0]
    why = (f"{name} returns a view in torch, a copy on global tensors (it has no sharding rule "
           f"and ran {ran}): an in-place op on it would not reach its input; write into the "
           f"input itself")

    def remake(i: int | None) -> Callable:
        def again(parent: GlobalTensor) -> GlobalTensor:
            out = _as_op(route, kind, func, [parent, *tensors[1:]], pos, kw)
            return out if i is None else out[i]
        return again

    if kind is None:
        return copy_view(result, tensors[0], remake(None), why)
    outs = [copy_view(o, tensors[0], remake(i), why) for i, o in enumerate(result)]
    return outs if kind is list else kind(outs)


def property_handler(descriptor: Any, name: str) -> Callable:
    """A Tensor property read on a global tensor: a value (``H``, ``mH``: a tensor on meta) runs
    as a function of the tensor (`fallback_for`); metadata (``is_sparse``, ``layout``) is read
    on this rank's shard, the same for the shard and the whole value."""
    probe = descriptor.__get__(torch.empty(2, 2, device="meta"))
    if not isinstance(probe, torch.Tensor):
        return lambda self: descriptor.__get__(self.local)

    def read(t: torch.Tensor) -> torch.Tensor:
        return descriptor.__get__(t)
    read.__name__ = read.__qualname__ = getattr(descriptor, "__name__", name)
    return fallback_for(read, name)


def _eager(func: Callable, name: str, tensors: list, pos: tuple, kw: tuple,
           pl: Placement, writes: frozenset = frozenset()) -> Any:
    """The call on the whole values, on every rank of ``pl`` (module docstring, route 3); the
    arguments at positions ``writes`` (the function writes into them) take their new values, in
    their own layouts."""
    if recording():
        raise UnsupportedTorchFunction(
            f"{name} cannot be part of a graph on global tensors: its result's shape depends "
            f"on the values, it is not tensors, it draws random numbers or it writes into its "
            f"arguments. Call it outside the graph's build, or use an op with a static shape")
    if _comm.rank() not in pl:
        raise UnsupportedTorchFunction(
            f"{name} on rank {_comm.rank()}, outside the placement {pl} of its inputs: its "
            f"result (a data-dependent shape, or not tensors) is known only on that placement; "
            f"call it on those ranks only")
    replicated = (B,) * pl.ndim
    full = tuple(t.to_global(sbp=replicated).local for t in tensors)
    if _is_random(func, call_spec(kw, full)):
        with _RNG_LOCK, torch.random.fork_rng(devices=[]):
            torch.manual_seed(_next_seed(None, None))
            result = func(*call_spec(pos, full), **call_spec(kw, full))
    else:
        result = func(*call_spec(pos, full), **call_spec(kw, full))
    for i in writes:  # positional arguments the function wrote into
        slot = pos[1][i] if i < len(pos[1]) else None
        if slot is not None and slot[0] == "X" and full[slot[1]] is not tensors[slot[1]].local:
            t = tensors[slot[1]]  # (a B tensor's own shard was written already)
            t._assign_(GlobalTensor(full[slot[1]], tuple(t.shape), pl, replicated))
    return _wrapped(result, pl)


def _wrapped(value: Any, pl: Placement) -> Any:
    """``value`` with each torch tensor in it a replicated global tensor on ``pl``."""
    if isinstance(value, torch.Tensor):
        return GlobalTensor(value, tuple(value.shape), pl, (B,) * pl.ndim)
    if isinstance(value, tuple):
        items = [_wrapped(v, pl) for v in value]
        return type(value)(items) if hasattr(value, "n_fields") else tuple(items)
    if isinstance(value, list):
        return [_wrapped(v, pl) for v in value]
    return value


def _write_out(out: Any, result: Any, name: str) -> Any:
    """``out=``: each global tensor of ``out`` takes its result's value (torch's semantics)."""
    outs = out if isinstance(out, (tuple, list)) else (out,)
    results = result if isinstance(result, (tuple, list)) else (result,)
    if len(outs) != len(results) or not all(isinstance(o, GlobalTensor) for o in outs):
        raise UnsupportedTorchFunction(f"{name}(..., out=): out must be global tensor(s), one "
                                       f"for each of its {len(results)} result(s)")
    for o, r in zip(outs, results):
        o._assign_(r)
    return out
