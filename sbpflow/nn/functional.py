"""``sf.nn.functional``: torch.nn.functional's names on global tensors.

Functions are either one registered op (``apply_op``) or compositions of ops whose layouts fall
out of the ops' signatures (e.g. softmax along a split axis: local max, all-reduce max, local
exp-sum, all-reduce sum — written as plain tensor code on global tensors).
"""

from __future__ import annotations

from ..tensor import GlobalTensor, apply_op

__all__ = ["linear", "relu", "gelu", "tanh", "sigmoid", "silu"]


def linear(x: GlobalTensor, weight: GlobalTensor, bias: GlobalTensor | None = None) -> GlobalTensor:
    """``x @ weight.T + bias`` with ``weight`` of shape (out, in), as ``torch.nn.functional``."""
    return apply_op("linear", x, weight) if bias is None else apply_op("linear", x, weight, bias)


def relu(x: GlobalTensor) -> GlobalTensor:
    return apply_op("relu", x)


def gelu(x: GlobalTensor, approximate: str = "none") -> GlobalTensor:
    return apply_op("gelu", x, approximate=approximate) if approximate != "none" else apply_op("gelu", x)


def tanh(x: GlobalTensor) -> GlobalTensor:
    return apply_op("tanh", x)


def sigmoid(x: GlobalTensor) -> GlobalTensor:
    return apply_op("sigmoid", x)


def silu(x: GlobalTensor) -> GlobalTensor:
    return apply_op("silu", x)
