"""CNN functions on global tensors, with ``torch.nn.functional``'s names and arguments:
``conv2d``, ``max_pool2d``, ``avg_pool2d``, ``adaptive_avg_pool2d``.

Each is one registered op (`sbpflow.ops.conv`, where the signatures are listed): batch and
channel splits run locally, an input-channel split of ``conv2d`` gives partial sums, and
average pooling keeps them partial. ``sf.nn.functional`` re-exports these names.
"""

from __future__ import annotations

from ..tensor import GlobalTensor, apply_op, lifting_plain_tensors

__all__ = ["conv2d", "max_pool2d", "avg_pool2d", "adaptive_avg_pool2d"]


@lifting_plain_tensors
def conv2d(input: GlobalTensor, weight: GlobalTensor, bias: GlobalTensor | None = None,
           stride=1, padding=0, dilation=1, groups: int = 1) -> GlobalTensor:
    """2-D convolution: ``input`` (N, C, H, W) or (C, H, W), ``weight`` (O, C/groups, kH, kW),
    ``bias`` (O,). ``padding`` may be an int, a pair, ``"same"`` or ``"valid"``."""
    return apply_op("conv2d", input, weight, bias, stride, padding, dilation, groups)


def max_pool2d(input: GlobalTensor, kernel_size, stride=None, padding=0, dilation=1,
               ceil_mode: bool = False, return_indices: bool = False):
    """2-D max pooling; with ``return_indices`` also the (global tensor of) arg-max indices,
    flat within each (H, W) plane as in torch."""
    return apply_op("max_pool2d", input, kernel_size, stride, padding, dilation, ceil_mode,
                    return_indices)


def avg_pool2d(input: GlobalTensor, kernel_size, stride=None, padding=0, ceil_mode: bool = False,
               count_include_pad: bool = True, divisor_override: int | None = None) -> GlobalTensor:
    """2-D average pooling (linear: a partial-sum input stays partial)."""
    return apply_op("avg_pool2d", input, kernel_size, stride, padding, ceil_mode,
                    count_include_pad, divisor_override)


def adaptive_avg_pool2d(input: GlobalTensor, output_size) -> GlobalTensor:
    """Adaptive 2-D average pooling to ``output_size`` (an int or an (H, W) pair, either may be
    None to keep the input's size)."""
    return apply_op("adaptive_avg_pool2d", input, output_size)
