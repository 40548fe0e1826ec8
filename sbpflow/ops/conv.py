"""The CNN family: ``conv2d``, ``max_pool2d``, ``avg_pool2d``, ``adaptive_avg_pool2d``.

Arguments are positional as in ``torch.nn.functional``. ``conv2d`` splits the batch, the
output channels, the input channels (partial sums) or whole groups; pooling splits the batch
or the channels; no H / W splits (a window straddles the cut). Empty shards are legal. See
docs/internals.md, 'Convolution and pooling signatures' (the tables, grouped convs, why max
pooling has no ``P(max)`` signature).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import ShapeError
from .registry import Signature, TensorMeta, register

__all__ = ["conv2d_signatures", "pool_signatures", "max_pool2d_signatures",
           "avg_pool2d_signatures"]


# -- helpers ----------------------------------------------------------------------------------
def _connect(out: torch.Tensor, *inputs) -> torch.Tensor:
    """``out`` plus a zero that depends on every tensor input (so backward reaches them)."""
    for t in inputs:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            out = out + t.reshape(-1)[:0].sum()
    return out


def _meta(*shape, dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _spatial_out(fn, x: torch.Tensor, *consts) -> tuple:
    """Output (H, W) of pooling ``fn`` on one nonempty plane of ``x``'s spatial size."""
    res = fn(_meta(1, 1, *x.shape[-2:], dtype=x.dtype), *consts)
    res = res[0] if isinstance(res, (tuple, list)) else res
    return tuple(res.shape[-2:])


# -- conv2d -----------------------------------------------------------------------------------
def _local_groups(x: torch.Tensor, w: torch.Tensor, groups: int) -> int:
    """The group count of this shard: ``groups`` unless ``x`` and ``w`` hold a channel shard of
    a grouped conv with O == C (the group split), where it is ``C_local / (C / groups)``."""
    c = x.shape[-3] if x.ndim >= 3 else -1
    if groups == 1 or w.ndim != 4 or c == w.shape[1] * groups:
        return groups
    if w.shape[1] > 0 and c == w.shape[0] and c % w.shape[1] == 0:
        return c // w.shape[1]
    return groups  # not a shard we know: let torch report the mismatch


def _conv2d(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    g = _local_groups(x, weight, groups)
    if x.ndim in (3, 4) and weight.ndim == 4 and (x.numel() == 0 or weight.numel() == 0):
        # an empty shard: torch refuses some empty sizes (no output channels, no groups)
        c_per_group = max(weight.shape[1], 1)
        hw = F.conv2d(_meta(1, c_per_group, *x.shape[-2:], dtype=x.dtype),
                      _meta(1, c_per_group, *weight.shape[-2:], dtype=weight.dtype),
                      None, stride, padding, dilation, 1).shape[-2:]
        shape = tuple(x.shape[:-3]) + (weight.shape[0],) + tuple(hw)
        out = torch.zeros(shape, dtype=x.dtype, device=x.device)
        if bias is not None:
            out = out + bias.reshape(-1, 1, 1)
        return _connect(out, x, weight)
    return F.conv2d(x, weight, bias, stride, padding, dilation, g)


def conv2d_signatures(x: TensorMeta, w: TensorMeta, b: TensorMeta | None = None, stride=1,
                      padding=0, dilation=1, groups=1) -> list[Signature]:
    with_bias = isinstance(b, TensorMeta)
    if x.ndim not in (3, 4) or w.ndim != 4:
        raise ShapeError(f"conv2d: input of shape {x.shape} must be (N, C, H, W) or (C, H, W) "
                         f"and weight of shape {w.shape} (O, C/groups, kH, kW)")
    c = x.ndim - 3  # channel axis of x and of the output
    if x.shape[c] != w.shape[1] * groups:
        raise ShapeError(f"conv2d: input of shape {x.shape} has {x.shape[c]} channels but weight "
                         f"of shape {w.shape} with groups={groups} expects "
                         f"{w.shape[1]} x {groups} = {w.shape[1] * groups}")

    def sig(sx, sw, sb, out):
        return Signature([sx, sw] + ([sb] if with_bias else []), [out])

    sigs = []
    if x.ndim == 4:
        sigs.append(sig("S(0)", "B", "B", "S(0)"))                  # batch
    if groups == 1:
        sigs.append(sig("B", "S(0)", "S(0)", f"S({c})"))             # output channels
        sigs.append(sig(f"S({c})", "S(1)", "P", "P"))                # input channels
    elif w.shape[0] == x.shape[c]:
        sigs.append(sig(f"S({c})", "S(0)", "S(0)", f"S({c})"))       # whole groups
    sigs += [sig("P", "B", "P", "P"), sig("B", "P", "P", "P"), sig("B", "B", "B", "B")]
    return sigs


register("conv2d", _conv2d, conv2d_signatures, same_dtype=True,
         doc="F.conv2d(x, weight, bias, stride, padding, dilation, groups): batch, channel "
             "(output; input as partial sums; whole groups) and partial signatures")


# -- pooling ----------------------------------------------------------------------------------
def pool_signatures(x: TensorMeta, *, linear: bool = False, n_out: int = 1) -> list[Signature]:
    """Batch and channel splits, all-B; ``P -> P`` if ``linear``."""
    def sig(sx, out):
        return Signature([sx], [out] * n_out)

    sigs = [sig(f"S({a})", f"S({a})") for a in range(x.ndim - 2)] if x.ndim in (3, 4) else []
    sigs.append(sig("B", "B"))
    if linear:
        sigs.append(sig("P", "P"))
    return sigs


def _pool_kernel(fn):
    """``fn`` on local shards; an empty shard gives an empty result (torch refuses some)."""
    def kernel(x, *consts):
        if x.ndim in (3, 4) and x.numel() == 0:
            shape = tuple(x.shape[:-2]) + _spatial_out(fn, x, *consts)
            out = _connect(torch.zeros(shape, dtype=x.dtype, device=x.device), x)
            res = fn(_meta(1, 1, *x.shape[-2:], dtype=x.dtype), *consts)
            if isinstance(res, (tuple, list)):  # max_pool2d with return_indices
                return out, torch.zeros(shape, dtype=res[1].dtype, device=x.device)
            return out
        return fn(x, *consts)
    kernel.__name__ = fn.__name__
    return kernel


def max_pool2d_signatures(x: TensorMeta, kernel_size=None, stride=None, padding=0, dilation=1,
                          ceil_mode=False, return_indices=False) -> list[Signature]:
    return pool_signatures(x, n_out=2 if return_indices else 1)


def avg_pool2d_signatures(x: TensorMeta, *consts) -> list[Signature]:
    return pool_signatures(x, linear=True)


register("max_pool2d", _pool_kernel(F.max_pool2d), max_pool2d_signatures,
         doc="F.max_pool2d(x, kernel_size, stride, padding, dilation, ceil_mode, return_indices)")
register("avg_pool2d", _pool_kernel(F.avg_pool2d), avg_pool2d_signatures,
         doc="F.avg_pool2d(x, kernel_size, stride, padding, ceil_mode, count_include_pad, "
             "divisor_override): linear, keeps partial sums")
register("adaptive_avg_pool2d", _pool_kernel(F.adaptive_avg_pool2d), avg_pool2d_signatures,
         doc="F.adaptive_avg_pool2d(x, output_size): linear, keeps partial sums")
