"""Torch functions with no rule of their own run as their decompositions into ops that have one.

`decomposed(func, tensors, pos, kw)` traces the call on meta tensors of the logical shapes
(``make_fx``): a composite function (``torch.diff``, ``F.kl_div``, ``torch.tensordot``) comes
out as the aten ops it is made of, and an op torch ships a decomposition for
(``torch._decomp.decomposition_table``: ``addr``, ``triu``, ``huber_loss``, ...) is traced
through it. The trace is kept only when every aten op in it has a layout rule in sbpflow
(pointwise by torch's tag, or a handler of its torch function, `covered`) and none draws
random numbers; `replay` then runs it on the global tensors, each op by its own rule, so
nothing is gathered that those rules do not gather, and autograd goes through the ops. A
trace is logical, so one serves every layout of the same shapes. Else the caller runs the
function replicated (`torch_fallback`).
"""

from __future__ import annotations

import operator
import threading
from typing import Any, Callable

import torch
from torch._decomp import decomposition_table
from torch.fx.experimental.proxy_tensor import make_fx

from ..ops.torch_generic import call_spec
from ..tensor import GlobalTensor

__all__ = ["decomposed", "replay", "use_handlers"]

_MAX_PASSES = 4  # each pass decomposes the ops the last trace left uncovered
_TRACE_LOCK = threading.Lock()  # make_fx keeps its tracer in process-wide state: one at a time


def _slice(x, dim: int = 0, start=None, end=None, step: int = 1):
    return x[(slice(None),) * (dim % x.dim()) + (slice(start, end, step),)]


# aten ops whose torch function has another name or other arguments; any other aten op runs as
# the public torch function (or Tensor method) of its own name
_AS_TORCH: dict[str, Callable] = {
    "slice": _slice,
    "view": lambda x, size: x.view(size),
    "_unsafe_view": lambda x, size: x.reshape(size),
    "expand": lambda x, size, implicit=False: x.expand(size),
    "alias": lambda x: x.view(x.shape),
    "lift_fresh_copy": torch.clone,
    "_softmax": lambda x, dim, half_to_float: torch.softmax(x, dim),
    "_log_softmax": lambda x, dim, half_to_float: torch.log_softmax(x, dim),
    "_to_copy": lambda x, **kw: x.to(**{k: v for k, v in kw.items() if k in ("dtype",)}),
}


_HANDLER_OF: list = []  # torch_functions.handler_for, which builds on this module's caller


def use_handlers(handler_of: Callable) -> None:
    """``handler_of(func)``: the handler a torch function runs by on global tensors."""
    _HANDLER_OF[:] = [handler_of]


def _torch_function(op: torch._ops.OpOverload) -> Callable | None:
    """The torch-level function an aten overload runs as on global tensors, or None."""
    name = op.overloadpacket.__name__
    if name in _AS_TORCH:
        return _AS_TORCH[name]
    if name.startswith("_"):
        return None
    func = getattr(torch, name, None)
    if func is None and hasattr(torch.Tensor, name):
        func = _METHODS.get(name) or _METHODS.setdefault(name, _method(name))
    return func


_METHODS: dict[str, Callable] = {}


def _method(name: str) -> Callable:
    """``Tensor.<name>`` called as a method of its first argument (a global tensor: torch's
    own descriptor takes only torch tensors)."""
    def call(self, *args, **kwargs):
        return getattr(self, name)(*args, **kwargs)
    call.tensor_method = getattr(torch.Tensor, name)
    return call


def _has_tensor(args: tuple, kwargs: dict) -> bool:
    leaves = list(args) + list(kwargs.values())
    return any(isinstance(a, torch.fx.Node) or (isinstance(a, (list, tuple)) and
                                                 _has_tensor(tuple(a), {})) for a in leaves)


def covered(node: torch.fx.Node) -> bool:
    """The node runs on global tensors by a rule of sbpflow's: its aten op is pointwise by
    torch's tag, or its torch function has a handler; a factory (no tensor argument) that
    draws nothing runs on every rank as it is; ``getitem`` picks a result."""
    if node.target is operator.getitem:
        return True
    op = node.target
    if not isinstance(op, torch._ops.OpOverload) or {torch.Tag.nondeterministic_seeded,
                                                      torch.Tag.inplace_view} & set(op.tags):
        return False  # (a draw, or an in-place change of a view's shape: squeeze_, t_)
    if not _has_tensor(node.args, node.kwargs):
        return True
    if torch.Tag.pointwise in op.tags:
        return True
    func = _torch_function(op)
    if func is None:
        return False
    if func in _AS_TORCH.values():
        return True
    handler = _HANDLER_OF[0](getattr(func, "tensor_method", func))
    return not getattr(handler, "fallback", False) and not getattr(handler, "refuses", False)


def _trace(func: Callable, metas: tuple, pos: tuple, kw: tuple, table: dict):

    def call(*ts):
        return func(*call_spec(pos, ts), **call_spec(kw, ts))
    with _TRACE_LOCK:
        return make_fx(call, decomposition_table=table)(*metas)


def decomposed(func: Callable, tensors: list, pos: tuple, kw: tuple):
    """The aten graph of this call, every op of it covered (module docstring); None where the
    call cannot be traced on meta tensors or an op of it has neither a rule nor a
    decomposition."""
    metas = tuple(torch.empty(t.shape, dtype=t.dtype, device="meta") for t in tensors)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    table: dict = {}
    for _ in range(_MAX_PASSES):
        try:
            gm = _trace(func, metas, pos, kw, table)
        except Exception:  # noqa: BLE001 - no meta kernel, a data-dependent shape, ...
            return None
        missing = [n.target for n in gm.graph.nodes if n.op == "call_function" and
                   not covered(n)]
        if any(n.op == "get_attr" for n in gm.graph.nodes):
            return None  # a tensor constant made on meta: nothing to run it with
        if not missing:
            return None if _only(gm, func) or not _replays(gm, metas) else gm
        if not all(op in decomposition_table and op not in table for op in missing) or grad:
            return None  # (a table's decomposition computes torch's value, not always its
            # derivative: at a norm's zero or a softmax's -inf row it differs from the op's own)
        table.update({op: decomposition_table[op] for op in missing})
    return None


def _replays(gm, metas: tuple) -> bool:
    """Each node of the trace, run as `replay` runs it but on the meta tensors, gives the
    shape and dtype the trace recorded (a torch function of an aten op's name takes the op's
    arguments)."""
    def same(a, b) -> bool:
        if isinstance(b, torch.Tensor):
            return isinstance(a, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype
        if isinstance(b, (tuple, list)):
            return isinstance(a, (tuple, list)) and len(a) == len(b) and \
                all(same(x, y) for x, y in zip(a, b))
        return True
    env, placeholders = {}, iter(metas)
    try:
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                env[node] = next(placeholders)
            elif node.op == "call_function":
                args, kwargs = _arguments(node, env)
                with torch.no_grad():
                    env[node] = _run(node.target, args, kwargs, torch.device("meta"), meta=True)
                if not same(env[node], node.meta.get("val")):
                    return False
    except Exception:  # noqa: BLE001 - the torch function does not take the op's arguments
        return False
    return True


def _only(gm, func: Callable) -> bool:
    """The trace is the function itself, one aten op of its name: nothing was decomposed."""
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function" and
           n.target is not operator.getitem]
    return len(ops) == 1 and _torch_function(ops[0]) is func


def replay(gm, tensors: list, device: torch.device) -> Any:
    """Run the traced graph on ``tensors`` (global tensors, in the trace's order): each aten op
    as its torch function on global tensors (`_torch_function`), a factory on ``device``."""
    env: dict = {}
    placeholders = iter(tensors)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = next(placeholders)
        elif node.op == "output":
            return _plain(torch.fx.node.map_arg(node.args[0], lambda n: env[n]))
        else:
            args, kwargs = _arguments(node, env)
            env[node] = _run(node.target, args, kwargs, device)
    raise AssertionError("an fx graph ends with its output node")


def _arguments(node: torch.fx.Node, env: dict) -> tuple[tuple, dict]:
    """The node's arguments with the values computed so far, in plain lists and tuples (fx
    gives its own immutable kinds, which a handler's ``type(x) is list`` would not take)."""
    return _plain(torch.fx.node.map_arg(node.args, lambda n: env[n])), \
        {k: _plain(v) for k, v in torch.fx.node.map_arg(node.kwargs, lambda n: env[n]).items()}


def _plain(value: Any) -> Any:
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_plain(v) for v in value)
    return value


def _run(target: Callable, args: tuple, kwargs: dict, device: torch.device,
         meta: bool = False) -> Any:
    """One node: on global tensors as its torch function; ``meta``: the inputs are the meta
    tensors of a check (`_replays`), each an input or what the trace made of one."""
    if target is operator.getitem:
        return target(*args)
    if "device" in kwargs:  # the trace's meta device: the rank's
        kwargs = {**kwargs, "device": device}
    leaves = _leaves(args, kwargs)
    if not any(isinstance(a, GlobalTensor) for a in leaves) and not (
            meta and any(isinstance(a, torch.Tensor) for a in leaves)):
        return target(*args, **kwargs)  # a factory, or ops on what factories made
    kwargs = {k: v for k, v in kwargs.items() if (k, v) not in _DEFAULTS}
    # (a pointwise aten op of no public name runs as itself: by its tag, shards kept)
    return (_torch_function(target) or target)(*args, **kwargs)


_DEFAULTS = {("pin_memory", False), ("layout", torch.strided)}  # the trace spells them out


def _leaves(args: tuple, kwargs: dict) -> list:
    out: list = []
    for a in list(args) + list(kwargs.values()):
        out.extend(_leaves(tuple(a), {}) if isinstance(a, (list, tuple)) else [a])
    return out
