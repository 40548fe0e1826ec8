"""Any torch function as an op: its own kernel on the shards, laid out by what torch knows of it.

Three generic ops run a torch function ``func`` whose tensor arguments are the op's inputs, put
back into the call's structure (``spec``, `call_spec`), with all ``B`` always valid:
``torch_pointwise`` (tagged ``torch.Tag.pointwise``: any output axis split, each input that has
it split alike, the others ``B``); ``torch_reduction`` (tagged ``torch.Tag.reduction``, of one
tensor over ``dims``, ``keepdim`` as torch's: any other axis keeps its split); and
``torch_replicated`` (any function, on the whole value on every rank). A spec is a hashable
tree: ``("T", items)`` a tuple, ``("L", items)`` a list, ``("D", keys, items)`` a dict, ``("X",
i)`` the i-th tensor input, ``("C", value)`` a constant. See docs/torch_models.md, 'What runs'.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .elementwise import broadcast_split_signatures
from .registry import Signature, TensorMeta, register, tensor_metas

__all__ = ["build_spec", "call_spec", "torch_call"]


def build_spec(value: Any, is_tensor: Callable[[Any], bool], tensors: list) -> tuple:
    """The spec of ``value``: each object ``is_tensor`` accepts is appended to ``tensors`` and
    stands as ``("X", i)``."""
    if is_tensor(value):
        tensors.append(value)
        return ("X", len(tensors) - 1)
    if type(value) is tuple:
        return ("T", tuple(build_spec(v, is_tensor, tensors) for v in value))
    if type(value) is list:
        return ("L", tuple(build_spec(v, is_tensor, tensors) for v in value))
    if type(value) is dict:
        return ("D", tuple(value), tuple(build_spec(v, is_tensor, tensors)
                                         for v in value.values()))
    return ("C", value)


def call_spec(spec: tuple, tensors: tuple) -> Any:
    """The value ``spec`` stands for, with ``tensors`` in its tensor slots."""
    tag = spec[0]
    if tag == "X":
        return tensors[spec[1]]
    if tag == "C":
        return spec[1]
    if tag == "D":
        return {k: call_spec(v, tensors) for k, v in zip(spec[1], spec[2])}
    items = [call_spec(v, tensors) for v in spec[1]]
    return items if tag == "L" else tuple(items)


def torch_call(*tensors, func: Callable, pos: tuple, kw: tuple) -> Any:
    """``func(*pos, **kw)`` (specs of the positional and keyword arguments) with the tensors in
    their slots: the kernel of both ops (on local shards, or meta tensors for the logical
    shapes)."""
    return func(*call_spec(pos, tensors), **call_spec(kw, tensors))


def _outputs(tensors: tuple, func: Callable, pos: tuple, kw: tuple) -> tuple:
    """The outputs' metadata, from the kernel on meta tensors."""
    metas = tuple(torch.empty(m.shape, dtype=m.dtype, device="meta") for m in tensors)
    with torch.no_grad():
        out = torch_call(*metas, func=func, pos=pos, kw=kw)
    out = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    return tuple(TensorMeta(tuple(o.shape), o.dtype) for o in out)


def _pointwise_signatures(*tensors, func, pos, kw) -> list[Signature]:
    metas = tensor_metas(tensors)
    outs = _outputs(tensors, func, pos, kw)
    shape = tuple(torch.broadcast_shapes(*(m.shape for m in metas)))
    replicated = Signature(["B"] * len(metas), ["B"] * len(outs))
    if any(o.shape != shape for o in outs):  # not shaped as a pointwise op: no split rule
        return [replicated]
    split = [Signature(s.ins, s.outs * len(outs))
             for s in broadcast_split_signatures(list(metas))[:-1]]
    return split + [replicated]


def _reduction_signatures(*tensors, func, pos, kw, dims, keepdim) -> list[Signature]:
    (meta,) = tensor_metas(tensors)
    n = len(_outputs(tensors, func, pos, kw))
    sigs = [Signature([f"S({a})"], [f"S({a if keepdim else a - sum(d < a for d in dims)})"] * n)
            for a in range(meta.ndim) if a not in dims]
    return sigs + [Signature(["B"], ["B"] * n)]


def _reduction_kernel(*tensors, func, pos, kw, dims, keepdim) -> Any:
    return torch_call(*tensors, func=func, pos=pos, kw=kw)


def _replicated_signatures(*tensors, func, pos, kw) -> list[Signature]:
    outs = _outputs(tensors, func, pos, kw)
    return [Signature(["B"] * len(tensor_metas(tensors)), ["B"] * len(outs))]


register("torch_pointwise", torch_call, _pointwise_signatures,
         doc="a torch function tagged pointwise: split on any output axis, or all B")
register("torch_reduction", _reduction_kernel, _reduction_signatures,
         doc="a torch function tagged reduction, of one tensor: other axes keep their split")
register("torch_replicated", torch_call, _replicated_signatures,
         doc="any torch function on the whole value: every input and output B")
