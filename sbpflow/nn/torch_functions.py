"""torch functions on global tensors: what `GlobalTensor.__torch_function__` runs.

``torch.*``, ``torch.nn.functional.*``, ``torch.nn.init.*`` and ``torch.Tensor`` methods called
with a global tensor are looked up, in order: a handler of the table (`torch_handlers`: the
sbpflow version of the function); the `GlobalTensor` method of the same name (``torch.flatten(x,
1)`` is ``x.flatten(1)``); for an in-place method ``name_``, ``name`` and then
`GlobalTensor._assign_`; anything else runs by what torch knows of it (`torch_fallback`: its
pointwise tag, else replicated: always correct). A metadata query (a Tensor property) reads this
rank's shard. Refused by name, with what to use instead: functions about a shard's storage
(`_STORAGE`), private ones (``_name``), and ``numpy``. Plain torch tensors among the arguments
(positions, masks, constants) are first taken as replicated on the global tensors' placement
(`sbpflow.tensor.lift`). The resolution is cached per function. See docs/torch_models.md,
'What runs'.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..errors import SbpError
from ..sbp import format_nd_sbp
from ..tensor import (GlobalTensor, UnsupportedTorchFunction, lift_arguments, numpy_names,
                      set_torch_dispatch)
from .torch_decomposed import use_handlers
from .torch_fallback import fallback_for, is_aten, property_handler
from .torch_indexing import write_plain, writes_plain

__all__ = ["dispatch", "register", "handler_for", "torch_name", "unsupported"]

# torch function (or Tensor property descriptor) -> handler(*args, **kwargs)
_HANDLERS: dict = {}
_FALLBACKS: dict = {}  # torch function -> its fallback, for arguments its handler refuses

# The GlobalTensor methods a torch function of the same name may NOT fall back to: their
# torch meaning differs (none today: max / min have torch's meaning and their own handlers).
_NO_FALLBACK: frozenset = frozenset()

# Functions about a shard's memory rather than the logical value: no fallback gives them a
# meaning (a replicated copy's storage is no tensor's), so they are refused by name.
_STORAGE = frozenset({
    "data_ptr", "untyped_storage", "storage", "storage_offset", "share_memory_",
    "is_shared", "pin_memory", "is_pinned", "set_", "resize_", "resize_as_", "record_stream",
    "apply_", "map_", "map2_", "register_hook", "register_post_accumulate_grad_hook",
    "__reduce_ex__", "__setstate__", "as_strided", "as_strided_", "stride",
})

_PRIVATE = ("It is private to torch and no aten op: call the public function it implements")

# What to say for functions with no sbpflow op, by name (the rest get the general advice).
_ADVICE = {
    "numpy": "Use x.full_tensor().numpy() (the whole value, on every rank)",
    "as_strided": "It reads a tensor's memory layout, which a global tensor does not have: "
                  "use view ops (reshape, narrow, unfold, expand, permute) on it, or "
                  "x.full_tensor().as_strided(...) for the whole value",
    "stride": "A global tensor has no strides of its own: each rank's shard (x.local) has its "
              "own; x.is_contiguous() is what most code asks",
}
_GENERAL = ("It concerns a shard's memory, not the logical value: use x.local (this rank's "
            "shard) or x.full_tensor() (the whole value, on every rank) for it. The functions "
            "that run are listed in docs/torch_models.md")


# torch's C-bound functions take numpy's argument names (`numpy_names`: ``torch.all(x,
# axis=-1, keepdims=True)``, as transformers' beam search calls it); Python ones do not
_C_BOUND = (type(torch.all), type(torch.Tensor.all))


def register(func, handler: Callable) -> None:
    """Run ``handler(*args, **kwargs)`` when torch function ``func`` meets a global tensor."""
    _HANDLERS[func] = handler


def torch_name(func) -> str:
    """``torch.nn.functional.linear``, ``Tensor.masked_fill``, ``torch.cat``: how a user wrote it."""
    name = getattr(func, "__name__", None) or getattr(getattr(func, "fget", None), "__name__",
                                                      repr(func))
    qual = getattr(func, "__qualname__", "") or ""
    module = getattr(func, "__module__", None) or ""
    if qual.startswith(("TensorBase.", "Tensor.")) or isinstance(
            func, type(torch.Tensor.is_cuda)) or not module:
        return f"Tensor.{name}"
    for sub, public in (("special", "special"), ("linalg", "linalg"), ("fft", "fft"),
                        ("nn", "nn.functional")):
        if module == f"torch._C._{sub}":
            return f"torch.{public}.{name.removeprefix(sub + '_')}"
    if module.startswith("torch._C") or module in ("torch.functional", "torch._tensor"):
        module = "torch"
    return f"{module}.{name}"


def _described(args: tuple, kwargs: dict) -> str:
    shown = [f"shape {tuple(a.shape)} with sbp {format_nd_sbp(a.sbp)}"
             for a in list(args) + list(kwargs.values()) if isinstance(a, GlobalTensor)]
    pl = next((a.placement for a in list(args) + list(kwargs.values())
               if isinstance(a, GlobalTensor)), None)
    return f"global tensor(s) of {'; '.join(shown)} on {pl}" if shown else "global tensors"


def unsupported(func, why: str = "") -> Callable:
    """A handler that refuses ``func`` with `UnsupportedTorchFunction`: its name, the
    arguments' layouts, why (if given) and what to use instead."""
    name = torch_name(func)
    short = name.rsplit(".", 1)[-1]
    advice = _ADVICE.get(short, _PRIVATE if why == "private to torch" else _GENERAL)

    def refuse(*args, **kwargs):
        reason = f" ({why})" if why else ""
        raise UnsupportedTorchFunction(f"{name} is not supported on sbpflow global tensors"
                                       f"{reason}; called with {_described(args, kwargs)}. "
                                       f"{advice}")
    refuse.refuses = True
    return refuse


def _method(name: str) -> Callable:
    def call(self, *args, **kwargs):
        return getattr(self, name)(*args, **kwargs)
    return call


def _in_place(out_of_place: Callable) -> Callable:
    def call(self, *args, **kwargs):
        return self._assign_(out_of_place(self, *args, **kwargs))
    return call


def handler_for(func) -> Callable:
    """The handler of ``func``: the table's, else that of the Tensor method of its name, else a
    same-named GlobalTensor method, else an in-place method built from its out-of-place version,
    else a refusal (cached)."""
    handler = _HANDLERS.get(func)
    if handler is not None:
        return handler
    name = getattr(func, "__name__", "")
    method = getattr(torch.Tensor, name, None) if name else None
    if method is not None and method is not func and method in _HANDLERS:
        handler = _HANDLERS[method]  # torch.is_floating_point(x) as x.is_floating_point()
    elif name and not name.startswith("_") and name not in _NO_FALLBACK and \
            callable(getattr(GlobalTensor, name, None)) and \
            not getattr(getattr(GlobalTensor, name), "torch_stub", False):
        handler = _method(name)
    elif name.endswith("_") and not name.startswith("_") and name not in _STORAGE and \
            hasattr(torch.Tensor, name[:-1]):
        base = handler_for(getattr(torch.Tensor, name[:-1]))
        handler = _in_place(base) if not getattr(base, "refuses", False) else unsupported(func)
    elif hasattr(func, "__get__") and not callable(func):  # a Tensor property
        handler = property_handler(func, torch_name(func))
    elif _refused(func, name):
        handler = unsupported(func, "private to torch" if name.startswith("_") else "")
    else:
        handler = fallback_for(func, torch_name(func))
    _HANDLERS[func] = handler
    return handler


def _refused(func, name: str) -> bool:
    """Refused by name: a function about a shard's memory (`_STORAGE`, `_ADVICE`), or a private
    one that is no aten op (``torch._chunk_cat`` is one; F.threshold is torch's private
    ``_threshold``, a public function)."""
    if name in _STORAGE or name in _ADVICE:
        return True
    if not name.startswith("_"):
        return False
    return getattr(func, "__module__", None) != "torch.nn.functional" and not is_aten(func)


def dispatch(func, args: tuple, kwargs: dict):
    """Run torch function ``func`` on ``args`` / ``kwargs`` holding global tensors. A handler
    that says it does not implement these arguments (a plain ``NotImplementedError``, as
    ``cross_entropy`` with class-probability targets) hands the call to the fallback, which
    is always correct; an `sf.SbpError` it raises stands (a refusal with its reason). A plain
    torch tensor written with global tensors takes their whole values (`write_plain`)."""
    if args and type(args[0]) is not GlobalTensor and writes_plain(func, args):
        return write_plain(func, args, kwargs)
    if kwargs and isinstance(func, _C_BOUND):   # (the checks skipped when they cannot apply:
        kwargs = _numpy_named(func, kwargs)     # this is every torch function's path)
    handler = _HANDLERS.get(func) or handler_for(func)
    args, kwargs = lift_arguments(args, kwargs)
    try:
        return handler(*args, **kwargs)
    except NotImplementedError as exc:
        if isinstance(exc, SbpError) or getattr(handler, "fallback", False):
            raise
        return _fallback(func)(*args, **kwargs)


_AXIS_NATIVE: dict = {}  # func -> its aten schema takes an argument named axis


def _numpy_named(func, kwargs: dict) -> dict:
    """numpy's ``axis=`` / ``keepdims=`` as torch's ``dim=`` / ``keepdim=``, unless ``func``'s own
    aten schema takes ``axis`` (``torch.segment_reduce``)."""
    if "axis" not in kwargs and "keepdims" not in kwargs:
        return kwargs
    native = _AXIS_NATIVE.get(func)
    if native is None:
        packet = getattr(torch.ops.aten, getattr(func, "__name__", "") or "", None)
        overloads = packet.overloads() if hasattr(packet, "overloads") else ()
        native = _AXIS_NATIVE[func] = any(a.name == "axis" for o in overloads
                                          for a in getattr(packet, o)._schema.arguments)
    return kwargs if native else numpy_names(kwargs)


def _fallback(func) -> Callable:
    """``func``'s fallback handler (for the arguments its own handler does not implement)."""
    handler = _FALLBACKS.get(func)
    if handler is None:
        handler = _FALLBACKS[func] = fallback_for(func, torch_name(func))
    return handler


set_torch_dispatch(dispatch)
use_handlers(handler_for)  # a decomposition runs when each of its ops has a rule
