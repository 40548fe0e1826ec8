"""Normalisation functions on global tensors, with ``torch.nn.functional``'s names and
arguments: ``batch_norm``, ``group_norm``, ``rms_norm``.

``batch_norm`` normalises over the LOGICAL batch in every layout: a batch split reduces the
per-channel sums across the ranks (SyncBatchNorm), a channel split is local. ``group_norm`` and
``rms_norm`` are one op each, or (``rms_norm`` over a split axis) a composition whose
all-reduce falls out of the ops. ``sf.nn.functional`` re-exports these names. See
docs/internals.md, 'Normalisation layers'.
"""

from __future__ import annotations

import math

import torch

from ..errors import PlacementMismatchError, ShapeError
from ..ops.norm_ops import stats_dtype
from ..sbp import B, Partial, Split, format_nd_sbp
from ..tensor import GlobalTensor, apply_op, lifting_plain_tensors, recording

__all__ = ["batch_norm", "group_norm", "rms_norm"]


def _describe(*named: tuple) -> str:
    parts = [f"{n} of shape {tuple(t.shape)} with sbp {format_nd_sbp(t.sbp)} on {t.placement}"
             for n, t in named if t is not None]
    return "; ".join(parts)


def _reduced(t: GlobalTensor) -> GlobalTensor:
    """``t`` with every partial mesh dim reduced (P -> B: the all-reduce)."""
    nd = tuple(B if isinstance(s, Partial) else s for s in t.sbp)
    return t if nd == t.sbp else t.to_global(sbp=nd)


def _check_vectors(what: str, x: GlobalTensor, size: int, **vectors) -> None:
    """Every given vector is (size,) and on ``x``'s placement (the running statistics are
    updated in place, so they cannot be moved here)."""
    for name, t in vectors.items():
        if t is None:
            continue
        if tuple(t.shape) != (size,):
            raise ShapeError(f"{what}: {name} must have shape ({size},) for input of shape "
                             f"{tuple(x.shape)}, as in torch; {_describe(('input', x), (name, t))}")
        if t.placement != x.placement:
            raise PlacementMismatchError(
                f"{what}: {name} is on {t.placement} but the input on {x.placement}; move it "
                f"with {name}.to_global(input.placement, sbp) first (sf.nn's modules move "
                f"their buffers themselves)")


def batch_norm(input: GlobalTensor, running_mean: GlobalTensor | None,
               running_var: GlobalTensor | None, weight: GlobalTensor | None = None,
               bias: GlobalTensor | None = None, training: bool = False,
               momentum: float | None = 0.1, eps: float = 1e-5, *,
               num_batches_tracked: GlobalTensor | None = None) -> GlobalTensor:
    """``torch.nn.functional.batch_norm`` on ``input`` (N, C, *), statistics over every axis
    but 1 of the logical tensor. Training: batch statistics (a batch or spatial split
    all-reduces one (2, C) tensor forward and one backward: SyncBatchNorm; a channel split
    communicates nothing), and the running statistics, if given, updated in place as torch
    (unbiased variance, ``momentum``). ``num_batches_tracked`` (sbpflow's addition, what
    `sf.nn.BatchNorm2d` passes): a 0-d int64 tensor incremented here; with ``momentum=None``
    the factor is ``1 / num_batches_tracked`` (a cumulative average). Not training: the
    running statistics (torch's kernel on each shard, no communication).
    The running statistics must be on ``input``'s placement (written in place)."""
    if input.ndim < 2:
        raise ShapeError(f"batch_norm: input of shape {tuple(input.shape)} must be (N, C) or "
                         f"(N, C, *); {_describe(('input', input))}")
    c = input.shape[1]
    _check_vectors("batch_norm", input, c, running_mean=running_mean, running_var=running_var,
                   weight=weight, bias=bias)
    if (running_mean is None) != (running_var is None):
        raise ValueError("batch_norm: give both running_mean and running_var, or neither")
    if not training:
        if running_mean is None:
            raise ValueError("batch_norm: running_mean and running_var must be given when not "
                             "training (as torch)")
        return apply_op("batch_norm_eval", input, running_mean, running_var, weight, bias,
                        eps=float(eps))
    count = input.numel() // c if c else 0
    if count == 1:
        raise ValueError(f"Expected more than 1 value per channel when training, got input "
                         f"size {tuple(input.shape)}")
    # the sums are taken around the running mean (the same on every rank); a copy, because
    # the update below writes the running mean before the normalisation reads the shift
    shift = None if running_mean is None else apply_op("clone", running_mean)
    sums = _reduced(apply_op("batch_norm_stats", input, shift))
    after = None
    if running_mean is not None:
        after = _update_running(running_mean, running_var, sums, num_batches_tracked, count,
                                momentum)
    return apply_op("batch_norm_train", input, sums, shift, weight, bias, after, count=count,
                    eps=float(eps))


def _update_running(running_mean: GlobalTensor, running_var: GlobalTensor, sums: GlobalTensor,
                    nbt: GlobalTensor | None, count: int,
                    momentum: float | None) -> GlobalTensor:
    """The in-place update op, told to keep each buffer in its own layout (so its kernel
    writes into the buffers' shards; the sums are boxed to them). Returns its 0-d result,
    which the normalisation reads: a graph keeps only the ops its outputs need."""
    if momentum is None and nbt is None:
        raise ValueError("batch_norm: momentum=None (a cumulative average) needs "
                         "num_batches_tracked")
    if nbt is not None and (tuple(nbt.shape) != () or nbt.placement != running_mean.placement):
        raise ShapeError(f"batch_norm: num_batches_tracked must be a 0-d tensor on the "
                         f"running statistics' placement; {_describe(('it', nbt))}")
    tensors = [running_mean, running_var, sums.detach()] + ([nbt] if nbt is not None else [])
    forced = [running_mean.sbp, running_var.sbp, None] + ([nbt.sbp] if nbt is not None else [])
    buffers = [t for t in (running_mean, running_var, nbt) if t is not None]
    # a graph's trace runs build once before its first call replays it on the same batch:
    # undo the traced update, or that batch would count twice
    before = [t.local.clone() for t in buffers] if recording() else None
    with torch.no_grad():
        done = apply_op("batch_norm_update_", *tensors, sbp=forced, count=count,
                        momentum=None if momentum is None else float(momentum))
        for t, value in zip(buffers, before or ()):
            t.local.copy_(value)
    return done


@lifting_plain_tensors
def group_norm(input: GlobalTensor, num_groups: int, weight: GlobalTensor | None = None,
               bias: GlobalTensor | None = None, eps: float = 1e-5) -> GlobalTensor:
    """``torch.nn.functional.group_norm`` on ``input`` (N, C, *): local with the batch split or
    with each rank holding whole groups of channels; other layouts are boxed to one of those."""
    if input.ndim < 2:
        raise ShapeError(f"group_norm: input of shape {tuple(input.shape)} must be (N, C, *); "
                         f"{_describe(('input', input))}")
    c = input.shape[1]
    if num_groups <= 0 or c % num_groups:
        raise ShapeError(f"group_norm: {c} channels are not divisible by num_groups "
                         f"{num_groups} (torch: 'Expected number of channels in input to be "
                         f"divisible by num_groups'); {_describe(('input', input))}")
    _check_vectors("group_norm", input, c, weight=weight, bias=bias)
    return apply_op("group_norm", input, weight, bias, num_groups=int(num_groups),
                    eps=float(eps))


@lifting_plain_tensors
def rms_norm(input: GlobalTensor, normalized_shape, weight: GlobalTensor | None = None,
             eps: float | None = None) -> GlobalTensor:
    """``torch.nn.functional.rms_norm``: ``x / sqrt(mean(x²) + eps) * weight`` over the trailing
    ``normalized_shape``; ``eps=None`` is the epsilon of the computation dtype, as torch.
    With the normalised axes whole on each rank: torch's kernel. With one split (hidden-dim
    tensor parallelism): local sums of squares, one all-reduce, computed in float32 for
    16-bit inputs as torch."""
    ns = (int(normalized_shape),) if isinstance(normalized_shape, int) else \
        tuple(int(n) for n in normalized_shape)
    shape = tuple(input.shape)
    if len(ns) > len(shape) or shape[len(shape) - len(ns):] != ns:
        raise ShapeError(f"rms_norm: normalized_shape {ns} does not match the trailing dims of "
                         f"input shape {shape}; {_describe(('input', input))}")
    if weight is not None and tuple(weight.shape) != ns:
        raise ShapeError(f"rms_norm: weight must have the normalized_shape {ns}, as in torch; "
                         f"{_describe(('input', input), ('weight', weight))}")
    dims = tuple(range(input.ndim - len(ns), input.ndim))
    if not any(isinstance(s, Split) and s.axis in dims for s in input.sbp):
        return apply_op("rms_norm", input, ns, weight, None if eps is None else float(eps))
    acc = stats_dtype(input.dtype)
    x = input.to(acc)
    e = torch.finfo(acc).eps if eps is None else float(eps)
    mean_sq = _reduced((x * x).sum(dim=dims, keepdim=True)) / math.prod(ns)
    y = (x * (mean_sq + e).rsqrt()).to(input.dtype)
    return y if weight is None else y * weight
