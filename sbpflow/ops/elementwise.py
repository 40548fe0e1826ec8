"""Elementwise ops with broadcasting: unary, binary, comparisons, casts.

Signatures (one mesh dim):

* every output axis ``a`` may be split: each tensor input that has the axis (not broadcast from
  size 1) is split on its own matching axis, the others are ``B``;
* all ``B`` gives ``B``;
* linear ops keep partial sums: ``P + P -> P``, ``P - P -> P``, ``-P -> P``, ``P * B -> P``,
  ``B * P -> P``, ``P / B -> P``, ``P * scalar -> P``. ``P + B`` (or ``P + scalar``) is not
  valid: the constant would be counted once per rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .registry import Signature, TensorMeta, register, tensor_metas

__all__ = ["broadcast_split_signatures", "UNARY", "BINARY"]


def _out_shape(metas: list[TensorMeta]) -> tuple:
    return tuple(torch.broadcast_shapes(*(m.shape for m in metas)))


def broadcast_split_signatures(metas: list[TensorMeta]) -> list[Signature]:
    """``S`` on each output axis (inputs follow through broadcasting) and all-``B``."""
    out = _out_shape(metas)
    sigs = []
    for a in range(len(out)):
        ins = []
        for m in metas:
            ax = a - (len(out) - m.ndim)
            ins.append(f"S({ax})" if ax >= 0 and m.shape[ax] == out[a] else "B")
        sigs.append(Signature(ins, [f"S({a})"]))
    sigs.append(Signature(["B"] * len(metas), ["B"]))
    return sigs


def _nonlinear(*args, **attrs):
    return broadcast_split_signatures(tensor_metas(args))


def _sum_like(*args, **attrs):
    """add / sub: partial only when every operand is a partial tensor (no constants)."""
    metas = tensor_metas(args)
    sigs = broadcast_split_signatures(metas)
    if len(metas) == len(args):
        sigs.append(Signature(["P"] * len(metas), ["P"]))
    return sigs


def _product_like(*args, **attrs):
    """mul: one operand partial, the others replicated."""
    metas = tensor_metas(args)
    sigs = broadcast_split_signatures(metas)
    for i in range(len(metas)):
        sigs.append(Signature(["P" if j == i else "B" for j in range(len(metas))], ["P"]))
    return sigs


def _quotient_like(*args, **attrs):
    """div: the numerator partial, the denominator replicated."""
    sigs = broadcast_split_signatures(tensor_metas(args))
    if isinstance(args[0], TensorMeta):
        n = len(tensor_metas(args))
        sigs.append(Signature(["P"] + ["B"] * (n - 1), ["P"]))
    return sigs


def _linear_unary(*args, **attrs):
    return _nonlinear(*args) + [Signature(["P"], ["P"])]


UNARY = {
    "neg": (torch.neg, _linear_unary),
    "exp": (torch.exp, _nonlinear), "log": (torch.log, _nonlinear),
    "sqrt": (torch.sqrt, _nonlinear), "rsqrt": (torch.rsqrt, _nonlinear),
    "abs": (torch.abs, _nonlinear), "sin": (torch.sin, _nonlinear), "cos": (torch.cos, _nonlinear),
    "tanh": (torch.tanh, _nonlinear), "sigmoid": (torch.sigmoid, _nonlinear),
    "relu": (torch.relu, _nonlinear), "silu": (F.silu, _nonlinear),
    "gelu": (F.gelu, _nonlinear), "square": (torch.square, _nonlinear),
    "reciprocal": (torch.reciprocal, _nonlinear), "logical_not": (torch.logical_not, _nonlinear),
    "bitwise_not": (torch.bitwise_not, _nonlinear),
    "isnan": (torch.isnan, _nonlinear), "erfinv": (torch.erfinv, _nonlinear),
    "clamp": (torch.clamp, _nonlinear),  # attributes min / max: constants
    "round": (torch.round, _nonlinear),  # attribute decimals
    "floor": (torch.floor, _nonlinear), "ceil": (torch.ceil, _nonlinear),
    "trunc": (torch.trunc, _nonlinear), "sign": (torch.sign, _nonlinear),
    "log1p": (torch.log1p, _nonlinear), "expm1": (torch.expm1, _nonlinear),
    "clone": (torch.clone, _linear_unary), "contiguous": (lambda x: x.contiguous(), _linear_unary),
}

BINARY = {
    "add": (lambda a, b: a + b, _sum_like), "sub": (lambda a, b: a - b, _sum_like),
    "mul": (lambda a, b: a * b, _product_like), "div": (lambda a, b: a / b, _quotient_like),
    "pow": (lambda a, b: a ** b, _nonlinear),
    "maximum": (torch.maximum, _nonlinear), "minimum": (torch.minimum, _nonlinear),
    "eq": (lambda a, b: a == b, _nonlinear), "ne": (lambda a, b: a != b, _nonlinear),
    "lt": (lambda a, b: a < b, _nonlinear), "le": (lambda a, b: a <= b, _nonlinear),
    "gt": (lambda a, b: a > b, _nonlinear), "ge": (lambda a, b: a >= b, _nonlinear),
    "logical_and": (torch.logical_and, _nonlinear), "logical_or": (torch.logical_or, _nonlinear),
    # ``&`` ``|`` ``^`` ``<<`` ``>>``: torch's operators (bitwise on integers, logical on bools,
    # torch's type promotion: long & bool -> long); a number may come first (``1 << x``)
    "bitwise_and": (lambda a, b: a & b, _nonlinear),
    "bitwise_or": (lambda a, b: a | b, _nonlinear), "bitwise_xor": (lambda a, b: a ^ b, _nonlinear),
    "bitwise_left_shift": (lambda a, b: a << b, _nonlinear),
    "bitwise_right_shift": (lambda a, b: a >> b, _nonlinear),
    "where": (torch.where, _nonlinear),
    "floor_divide": (torch.floor_divide, _nonlinear), "remainder": (torch.remainder, _nonlinear),
}

for _name, (_kernel, _sigs) in {**UNARY, **BINARY}.items():
    register(_name, _kernel, _sigs)


def _cast_signatures(x, dtype=None):
    sigs = _nonlinear(x)
    # a cast keeps partial sums for float targets only (ints would round each part)
    if dtype is not None and (dtype.is_floating_point or dtype.is_complex):
        sigs.append(Signature(["P"], ["P"]))
    return sigs


register("to_dtype", lambda x, dtype: x.to(dtype), _cast_signatures,
         doc="cast to another dtype (P kept for float targets)")
